"""H2O: the per-node kernel against a literal mask-based reference, a bounded cache, and speculative decoding
exactly lossless with respect to the H2O model (greedy identity; sampled law vs the enumerated H2O law)."""

from __future__ import annotations

import pytest
import torch
from lossless import SAMPLING_ALPHA, NoisyOracleDrafter
from stats import chi_square_pvalue
from tiny import make_dflash, make_target

from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.types import SpecStats
from byblock.kv.h2o import H2OConfig, HeadState, enable_h2o, evict, h2o_nodes, prefill_scores
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"


def reference_h2o(q, k, v, prompt_len, cfg, scale, window=None):
    """Literal H2O over a full sequence, one layer, with masks instead of gathers.

    q [H, N, D], k/v [Hkv, N, D]. The prompt is dense-causal, then evicted once; every later step t attends
    to the alive tokens and itself, adds its attention to the scores, and evicts down to the budget.
    Returns the outputs [H, N, D] and the final alive mask [Hkv, N]."""
    h, n, _ = q.shape
    hkv = k.shape[0]
    g = h // hkv
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    pos = torch.arange(n)
    alive = torch.zeros(hkv, n, dtype=torch.bool)
    scores = torch.zeros(hkv, n)
    out = torch.zeros_like(q)

    def visible_from(t):
        ok = pos <= t
        return ok & (t - pos < window) if window is not None else ok

    def shrink(t):
        for head in range(hkv):
            idx = torch.nonzero(alive[head]).flatten()  # in order of position
            if idx.numel() <= cfg.budget:
                continue
            old = idx[: idx.numel() - cfg.recent]
            s = scores[head, old].clone()
            if window is not None:
                s[old < t + 2 - window] = float("-inf")
            heavy = old[s.topk(cfg.heavy).indices]
            alive[head] = False
            alive[head, heavy] = True
            alive[head, idx[idx.numel() - cfg.recent :]] = True

    for t in range(n):
        if t < prompt_len:
            mask = visible_from(t).expand(h, n)
        else:
            alive[:, t] = True
            mask = alive.repeat_interleave(g, 0) & visible_from(t)
        logits = torch.einsum("hd,hnd->hn", q[:, t], kk) * scale
        w = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
        out[:, t] = torch.einsum("hn,hnd->hd", w, vv)
        scores += w.view(hkv, g, n).sum(1)
        if t == prompt_len - 1:
            alive[:, :prompt_len] = True
        if t >= prompt_len - 1:
            shrink(t)
    return out, alive


def run_kernel(q, k, v, prompt_len, cfg, scale, window=None, parents=None):
    """byblock's path: prompt scores + one eviction, then the remaining tokens as one block of nodes."""
    hkv, n, _ = k.shape
    pos = torch.arange(n)
    scores = prefill_scores(q[:, :prompt_len], k[:, :prompt_len], pos[:prompt_len], scale, window)
    p = pos[:prompt_len].expand(hkv, prompt_len)
    horizon = None if window is None else prompt_len + 1 - window
    keep = evict(scores, p, cfg, horizon)
    base = HeadState(keep, scores.gather(1, keep), p.gather(1, keep))
    idx = keep[..., None].expand(-1, -1, k.shape[-1])
    past_k, past_v = k[:, :prompt_len].gather(1, idx), v[:, :prompt_len].gather(1, idx)
    base = HeadState(torch.arange(keep.shape[1]).expand_as(keep), base.scores, base.pos)
    key = torch.cat([past_k, k[:, prompt_len:]], 1)
    value = torch.cat([past_v, v[:, prompt_len:]], 1)
    t = n - prompt_len
    parents = parents if parents is not None else list(range(-1, t - 1))
    return h2o_nodes(q[:, prompt_len:], key, value, base, pos[prompt_len:], parents, cfg, scale, window)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("cfg", [H2OConfig(heavy=3, recent=2), H2OConfig(heavy=0, recent=4), H2OConfig(5, 5)])
def test_kernel_matches_the_literal_reference(cfg, window):
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 24, 8), torch.randn(2, 24, 8), torch.randn(2, 24, 8)
    ref, alive = reference_h2o(q, k, v, 9, cfg, 0.5, window)
    out, states = run_kernel(q, k, v, 9, cfg, 0.5, window)
    torch.testing.assert_close(out, ref[:, 9:])
    kept = torch.zeros_like(alive)
    kept.scatter_(1, states[-1].pos, True)
    assert (kept == alive).all() and states[-1].pos.shape[1] == min(cfg.budget, 24)


def test_each_tree_node_sees_the_cache_of_its_own_path():
    torch.manual_seed(1)
    cfg, prompt_len = H2OConfig(heavy=2, recent=2), 6
    q, k, v = torch.randn(4, 12, 8), torch.randn(2, 12, 8), torch.randn(2, 12, 8)
    parents = [-1, 0, 0, 1, 2, 2]  # two branches under the root
    out, _ = run_kernel(q, k, v, prompt_len, cfg, 0.5, parents=parents)
    for node in range(6):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        cols = list(range(prompt_len)) + [prompt_len + i for i in reversed(path)]
        ref, _ = reference_h2o(q[:, cols], k[:, cols], v[:, cols], prompt_len, cfg, 0.5)
        torch.testing.assert_close(out[:, node], ref[:, -1])


def h2o_target(arch, heavy=4, recent=4):
    target = make_target(arch)
    target.h2o = enable_h2o(target.hf, H2OConfig(heavy=heavy, recent=recent))
    return target


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_cache_is_bounded_and_changes_the_model(arch):
    target = h2o_target(arch)
    ids = target.encode_prompt(PROMPT, chat=True)
    cache = target.new_cache()
    target.forward(torch.tensor([ids]), cache)
    for _ in range(5):
        cache.evict()
        target.forward(torch.tensor([[7]]), cache)
    cache.evict()
    assert cache.length == 8 and cache.next_position == len(ids) + 5
    compressed = target.forward(torch.tensor([[9]]), cache).logits[0, -1]
    full = make_target(arch)
    full_cache = full.new_cache()
    full.forward(torch.tensor([ids + [7] * 5]), full_cache)
    assert not torch.allclose(full.forward(torch.tensor([[9]]), full_cache).logits[0, -1], compressed)
    roomy = h2o_target(arch, heavy=200, recent=200)  # budget above every length: exactly the full model
    params = SamplingParams(max_new_tokens=24)
    assert generate(roomy, PROMPT, params).token_ids == generate(make_target(arch), PROMPT, params).token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_speculative_greedy_is_identical_to_plain_h2o(arch):
    target = h2o_target(arch)
    params = SamplingParams(max_new_tokens=40)
    plain = generate(target, PROMPT, params)
    assert plain.num_new_tokens == 40
    drafters = (
        NgramDrafter(NgramConfig(block_size=4)),
        NgramDrafter(NgramConfig(block_size=4, num_candidates=3)),
        DFlashDrafter(make_dflash(target, 6), target),
        DDTreeDrafter(DFlashDrafter(make_dflash(target, 6), target), budget=12),
    )
    for drafter in drafters:
        assert generate(target, PROMPT, params, drafter=drafter).token_ids == plain.token_ids, drafter.name
    reference = target.encode_prompt(PROMPT, chat=True) + plain.token_ids
    for seed in range(3):  # random trees whose side branches often carry the true token
        oracle = NoisyOracleDrafter(reference, block_size=6, tree=True, vocab=target.vocab_size, seed=seed)
        assert generate(target, PROMPT, params, drafter=oracle).token_ids == plain.token_ids


def test_speculative_sampling_follows_the_h2o_law():
    target = h2o_target("llama", heavy=2, recent=2)
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4)
    prompt = [5, 17, 33, 9, 5, 17]

    def next_law(prefix):  # plain H2O decoding: prompt prefill, then one token at a time
        cache = target.new_cache()
        logits = target.forward(torch.tensor([prompt]), cache).logits[0, -1]
        for tok in prefix:
            cache.evict()
            logits = target.forward(torch.tensor([[tok]]), cache).logits[0, -1]
        return process_logits(logits, params)

    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix, prob):
        if len(prefix) == 4:
            exact[tuple(prefix)] = prob
            return
        p = next_law(prefix)
        for t in torch.nonzero(p).flatten().tolist():
            expand([*prefix, t], prob * float(p[t]))

    expand([], 1.0)
    drafter = DDTreeDrafter(DFlashDrafter(make_dflash(target, block=4), target), budget=8)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(1500):
        loop = speculative_decode(target, drafter, prompt, params, g, SpecStats())
        samples.append(tuple(next(loop).token_id for _ in range(4)))
        loop.close()
    assert chi_square_pvalue(samples, exact) > SAMPLING_ALPHA


def test_h2o_refuses_batches_and_crops():
    target = h2o_target("llama")
    cache = target.new_cache()
    with pytest.raises(ValueError, match="one sequence"):
        target.forward(torch.tensor([[5, 6], [7, 8]]), cache)
    cache = target.new_cache()
    target.forward(torch.tensor([[5, 6, 7]]), cache)
    with pytest.raises(ValueError, match="never cropped"):
        cache.crop(1)


def test_h2o_flags_from_the_cli(tiny_llama_dir, tmp_path):
    import json
    import sys

    from cli_runs import run_all

    from byblock.drafters.dflash_format import save_dflash
    from byblock.models.loading import load_model

    dflash_dir = save_dflash(make_dflash(load_model(str(tiny_llama_dir)), block=4), tmp_path / "df", torch.float32)

    base = [sys.executable, "-m", "byblock.cli.main", "generate", PROMPT, "--model", str(tiny_llama_dir), "--json"]
    base += ["--max-new-tokens", "24", "--kv-h2o", "6", "--kv-h2o-recent", "4"]
    adaptive = ["--drafter", f"dflash:{dflash_dir}", "--adaptive"]  # its cost probe must not crop an H2O cache
    extras = {"plain": [], "ngram": ["--drafter", "ngram"], "adaptive": adaptive}
    bads = (["--kv-h2o-recent", "0"], ["--kv-quant", "int8"])
    results = run_all([[*base, *extra] for extra in [*extras.values(), *bads]])
    runs = {}
    for name, r in zip(extras, results, strict=False):
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout)["token_ids"]
    assert runs["plain"] == runs["ngram"] == runs["adaptive"]
    for b in results[len(extras) :]:
        assert b.returncode == 2 and len(b.stderr.strip().splitlines()) == 1, b.stderr
