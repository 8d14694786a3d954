"""Sparse decode/verify (--sparse-decode): the kernel against a brute-force reference, each row bitwise the same
alone or inside a verify (chain and tree), full budget = dense, and speculative decoding lossless with respect
to the sparse model, solo and batched."""

from __future__ import annotations

import pytest
import torch
from tiny import make_dflash, make_target

from byblock.attention.hf_stem import enable_stem
from byblock.attention.sparse_decode import sparse_decode_attention
from byblock.attention.stem import StemConfig
from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.sampling.params import SamplingParams

BS, K, W, SINKS = 8, 3, 8, 1


def qkv(seed: int, lq: int, lk: int, h: int = 4, hkv: int = 2, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, lq, d, generator=g)
    return q, torch.randn(1, hkv, lk, d, generator=g), torch.randn(1, hkv, lk, d, generator=g)


def run(q, k, v, mask=None, blocks=K, window=W, portable=False):
    return sparse_decode_attention(q, k, v, mask, 0.35, BS, blocks, window, SINKS, portable=portable)[0]


def brute_force(q, k, v, blocks=K, window=W):
    """Causal rows (new rows last), each KV head's allowed keys chosen by explicit loops over the Quest bound
    summed over the query heads it serves."""
    _, h, lq, d = q.shape
    hkv = k.shape[1]
    lk, groups = k.shape[2], h // hkv
    out = torch.zeros_like(q)
    for i in range(lq):
        p = lk - lq + i
        end = max(0, (p - window + 1) // BS)
        for g in range(hkv):
            kk, vv = k[0, g, : p + 1], v[0, g, : p + 1]
            allowed = torch.ones(p + 1, dtype=torch.bool)
            if end - SINKS > blocks:
                bounds = []
                for blk in range(SINKS, end):
                    tile = kk[blk * BS : (blk + 1) * BS]
                    bound = 0.0
                    for hh in range(g * groups, (g + 1) * groups):
                        qq = q[0, hh, i]
                        bound += float(sum(max(qq[j] * tile[:, j].max(), qq[j] * tile[:, j].min()) for j in range(d)))
                    bounds.append(bound)
                best = sorted(range(len(bounds)), key=lambda j: -bounds[j])[:blocks]
                allowed[SINKS * BS : end * BS] = False
                for j in best:
                    allowed[(SINKS + j) * BS : (SINKS + j + 1) * BS] = True
            for hh in range(g * groups, (g + 1) * groups):
                w = torch.softmax((kk @ q[0, hh, i]) * 0.35 + torch.where(allowed, 0.0, float("-inf")), 0)
                out[0, hh, i] = w @ vv
    return out


@pytest.mark.parametrize("portable", [False, True])  # the CPU row kernel (where it builds), gather + SDPA
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_brute_force(seed, portable):
    q, k, v = qkv(seed, lq=5, lk=90)
    torch.testing.assert_close(run(q, k, v, portable=portable), brute_force(q, k, v), rtol=1e-5, atol=1e-5)


def test_kept_block_summaries_equal_recomputed_ones_across_crops_and_compactions():
    """KeyBlockSummary (kv/block_summary.py) extends block by block and drops what a crop or a tree
    compaction rewrote; its extremes always equal a fresh computation, and attention with it is bitwise
    attention without it."""
    from byblock.kv.block_summary import KeyBlockSummary, block_extremes

    g = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 2, 120, 8, generator=g)
    summary = KeyBlockSummary(BS)
    for n in (3, 7, 7, 12):  # grows, repeats, grows again
        got = summary.extremes(keys, n)
        want = block_extremes(keys, n, BS)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    summary.crop(50)  # blocks 0..5 survive
    assert summary.valid == 50 // BS
    keys[:, :, 50:] = torch.randn(1, 2, 70, 8, generator=g)  # new tokens where rejected ones were
    assert torch.equal(summary.extremes(keys, 12)[0], block_extremes(keys, 12, BS)[0])
    slots = torch.cat([torch.arange(30), torch.arange(31, 60)])  # a tree path dropped slot 30
    summary.keep(slots)
    assert summary.valid == 30 // BS
    keys = torch.cat([keys[:, :, slots], torch.randn(1, 2, 61, 8, generator=g)], dim=2)
    assert torch.equal(summary.extremes(keys, 11)[1], block_extremes(keys, 11, BS)[1])
    q = torch.randn(1, 4, 3, 8, generator=g)
    kv = torch.randn(1, 2, keys.shape[2], 8, generator=g)
    with_summary = sparse_decode_attention(q, keys, kv, None, 0.35, BS, K, W, SINKS, summary)[0]
    assert torch.equal(with_summary, run(q, keys, kv))


def test_full_budget_is_dense_causal_attention():
    q, k, v = qkv(7, lq=4, lk=70)
    mask = torch.ones(4, 70, dtype=torch.bool).tril(diagonal=66)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.35
    )
    torch.testing.assert_close(run(q, k, v, blocks=100), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_each_verify_row_is_bitwise_its_decode_step(seed, portable):
    """Row i of a 6-row forward over L + 6 keys == the same query alone over its first L + i + 1 keys."""
    q, k, v = qkv(seed, lq=6, lk=100)
    together = run(q, k, v, portable=portable)
    for i in range(6):
        alone = run(q[:, :, i : i + 1], k[:, :, : 95 + i], v[:, :, : 95 + i], portable=portable)
        assert torch.equal(together[:, :, i], alone[:, :, 0]), i


@pytest.mark.parametrize("portable", [False, True])
def test_tree_rows_see_their_ancestors_as_plain_decoding_would(portable):
    """A tree verify (additive mask over committed keys + ancestors): each node's row equals the row decoded
    after its ancestors were committed in order."""
    past, parents = 90, [-1, 0, 0, 1, 2]  # node 0 is the root; 3 under 1, 4 under 2
    q, k, v = qkv(11, lq=5, lk=past + 5)
    allowed = torch.zeros(5, past + 5, dtype=torch.bool)
    allowed[:, :past] = True
    chains = []
    for n in range(5):
        chain, a = [], n
        while a >= 0:
            chain.append(a)
            a = parents[a]
        chains.append(chain[::-1])
        allowed[n, [past + a for a in chain]] = True
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    together = run(q, k, v, mask=additive, portable=portable)
    for n, chain in enumerate(chains):
        slots = list(range(past)) + [past + a for a in chain]
        alone = run(q[:, :, n : n + 1], k[:, :, slots], v[:, :, slots], portable=portable)
        assert torch.equal(together[:, :, n], alone[:, :, 0]), n


def test_window_must_cover_the_rows_of_a_forward():
    from byblock.errors import InvalidParameterError

    q, k, v = qkv(0, lq=9, lk=100)
    with pytest.raises(InvalidParameterError, match="sparse-decode-window"):
        run(q, k, v, window=8)


PROMPT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 4


def sparse_target(packed: bool = False):
    """packed: load_model's fp32 setup (packed GEMM, byblock's attention), where byblock's decoder forward runs."""
    model = make_target(packed=packed)
    cfg = StemConfig(
        block_size=BS, dense_layers=0, prefill=False, decode_blocks=2, decode_window=16, decode_min_tokens=0
    )
    return model, enable_stem(model.hf, cfg)


@pytest.mark.parametrize("packed", [False, True])  # transformers' modules; byblock's decoder on the packed GEMM
@pytest.mark.parametrize("kind", ["ngram", "dflash", "ddtree"])
def test_speculative_decoding_is_lossless_under_sparse_decode(kind, packed):
    model, density = sparse_target(packed)
    params = SamplingParams(max_new_tokens=40)
    plain = generate(model, PROMPT, params, chat=False)
    assert density.decode and max(density.decode.values()) < 0.8  # decode rows really skipped keys
    drafter = {
        "ngram": lambda: NgramDrafter(NgramConfig(block_size=4)),
        "dflash": lambda: DFlashDrafter(make_dflash(model, 6), model),
        "ddtree": lambda: DDTreeDrafter(DFlashDrafter(make_dflash(model, 6), model), budget=12),
    }[kind]()
    spec = generate(model, PROMPT, params, drafter=drafter, chat=False)
    assert spec.token_ids == plain.token_ids
    dense = generate(make_target(), PROMPT, params, chat=False)
    assert dense.num_new_tokens == plain.num_new_tokens


def test_batched_requests_are_their_solo_outputs_under_sparse_decode():
    model, _ = sparse_target()
    prompts = [PROMPT, PROMPT[:150] + " cats", PROMPT + "Once more:"]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)  # sampled: varied tokens, same per request
    solo = [generate(model, p, params, chat=False).token_ids for p in prompts]
    together = [r.token_ids for r in generate(model, prompts, params, chat=False)]
    assert together == solo and len(set(solo[0])) > 5


@pytest.mark.parametrize("straddle", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_verify_logits_are_bitwise_the_decode_steps(tree, straddle):
    """Model level, row-invariant fp32 linears: a 6-token verify forward (chain, or a tree whose path is those
    tokens) gives each path row bitwise the logits of decoding that token alone. straddle: the verify crosses
    --sparse-decode-min-tokens (its first rows dense, the rest sparse; the early decode steps take the dense
    kernel's shortcut)."""
    model = make_target(packed=True)
    ids = model.encode_prompt(PROMPT, chat=False)
    cfg = StemConfig(
        block_size=BS,
        dense_layers=0,
        prefill=False,
        decode_blocks=2,
        decode_window=16,
        decode_min_tokens=len(ids) + 3 if straddle else 0,
    )
    density = enable_stem(model.hf, cfg)
    new = [5, 17, 42, 9, 33, 12]
    cache = model.new_cache()
    model.forward(torch.tensor([ids]), cache)
    steps = [model.forward(torch.tensor([[t]]), cache).logits[0, -1] for t in new]
    assert max(density.decode.values()) < 0.8
    cache = model.new_cache()
    model.forward(torch.tensor([ids]), cache)
    if not tree:
        rows = model.forward(torch.tensor([new]), cache).logits[0]
        path = list(range(6))
    else:  # the path 0-1-2-3-4-5 interleaved with siblings 6, 7 (children of nodes 0 and 2)
        tokens = [*new, 77, 88]
        parents = [-1, 0, 1, 2, 3, 4, 0, 2]
        order = [0, 1, 6, 2, 7, 3, 4, 5]  # node order in the forward: parents first, siblings in between
        slot = {n: i for i, n in enumerate(order)}
        tm = torch.zeros(8, 8, dtype=torch.bool)
        for n in order:
            a = n
            while a >= 0:
                tm[slot[n], slot[a]] = True
                a = parents[a]
        start = cache.next_position
        depth = [0, 1, 2, 3, 4, 5, 1, 3]
        pos = torch.tensor([[start + depth[n] for n in order]])
        out = model.forward(torch.tensor([[tokens[n] for n in order]]), cache, positions=pos, tree_mask=tm)
        rows, path = out.logits[0], [slot[n] for n in range(6)]
    for j, r in enumerate(path):
        assert torch.equal(rows[r], steps[j]), j


def test_prompt_chunks_attend_densely_under_sparse_decode():
    """A chunked prefill (64-row chunks, more than the 16-position window) runs: prompt rows are not decode rows."""
    from byblock.engine.scheduler import BatchConfig

    model, _ = sparse_target()
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    batch = BatchConfig(max_batched_tokens=64, chunked_prefill=True)
    out = generate(model, [PROMPT, PROMPT + " again"], params, chat=False, batch=batch)
    assert [r.num_new_tokens for r in out] == [8, 8] and all(r.finish_reason.value == "length" for r in out)


@pytest.mark.parametrize("portable", [False, True])
def test_a_left_padded_row_is_its_unpadded_row(portable):
    """Padding shifts slots but not ranks: a row behind 13 pad slots chooses and reads what it would unpadded."""
    q, k, v = qkv(13, lq=3, lk=90)
    pad = 13
    kp, vp = (torch.cat([torch.randn(1, 2, pad, 8), t], dim=2) for t in (k, v))
    mask = torch.ones(3, 90 + pad, dtype=torch.bool).tril(diagonal=87 + pad)
    mask[:, :pad] = False
    padded = run(q, kp, vp, mask=mask[None, None], portable=portable)
    torch.testing.assert_close(padded, run(q, k, v, portable=portable), rtol=1e-6, atol=1e-6)


def test_sparse_decode_runs_in_byblocks_decoder_and_keeps_block_summaries():
    """With --sparse-decode alone the model keeps byblock's decoder forward (models/decoder.py); its decode steps
    equal the transformers path's, and the cache keeps each layer's block extremes between forwards."""
    model, _ = sparse_target(packed=True)
    assert model._decoder_runs
    reference, _ = sparse_target(packed=True)
    reference.decoder = None  # transformers' modules through stem_attention_forward
    ids = torch.randint(5, 200, (1, 70), generator=torch.Generator().manual_seed(3))
    caches = [model.new_cache(), reference.new_cache()]
    outs = [[m.forward(ids, c, logits_to_keep=1).logits] for m, c in zip((model, reference), caches, strict=True)]
    for step in range(4):
        tok = torch.tensor([[7 + step]])
        for m, c, o in zip((model, reference), caches, outs, strict=True):
            o.append(m.forward(tok, c, logits_to_keep=1).logits)
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert caches[0].key_summaries and all(s.valid == 73 // BS for s in caches[0].key_summaries.values())


@pytest.mark.parametrize("portable", [False, True])
def test_tied_blocks_are_chosen_alike_alone_and_in_a_verify(portable):
    """Blocks with equal bounds (repeated keys) go to the earlier block whether the row is decoded alone or beside
    5 others (a stable order, not topk's): the verify rows stay bitwise the decode steps."""
    q, k, v = qkv(21, lq=6, lk=100)
    for t in (k, v):
        t[:, :, 2 * BS : 3 * BS] = t[:, :, 5 * BS : 6 * BS]  # blocks 2 and 5, and 3 and 7, tie exactly
        t[:, :, 3 * BS : 4 * BS] = t[:, :, 7 * BS : 8 * BS]
    together = run(q, k, v, portable=portable)
    for i in range(6):
        alone = run(q[:, :, i : i + 1], k[:, :, : 95 + i], v[:, :, : 95 + i], portable=portable)
        assert torch.equal(together[:, :, i], alone[:, :, 0]), i
    torch.testing.assert_close(together, brute_force(q, k, v), rtol=1e-5, atol=1e-5)
