"""Batch invariance: every request the batched engine decodes gets exactly the tokens it gets alone.

Tiny random fp32 models on byblock's packed GEMM (row-invariant), every drafter, greedy and seeded sampling,
random prompt lengths, arrival steps, aborts and batch limits (hypothesis). The reference is `generate` on
one request with a fresh fork of the same drafter.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from engines import drive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import make_dflash, make_target

from byblock.drafters.adaptive import AdaptiveDrafter
from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.domino import DominoConfig, DominoDrafter, DominoHead
from byblock.drafters.draft_model import ModelDrafter
from byblock.drafters.hybrid import HybridDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.engine.batched import BatchedEngineCore
from byblock.engine.core import EngineRequest
from byblock.engine.scheduler import BatchConfig
from byblock.kernels.gqa_sdpa import PREFILL_TILE
from byblock.models.adapter import SegmentInput
from byblock.sampling.params import SamplingParams

REPETITIVE = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def _drafters(target) -> dict:
    from byblock.kernels.packed_gemm import load_kernel, pack_linears

    net = make_dflash(target, block=4)
    pack_linears(net, load_kernel())  # as build_drafter sets a drafter up beside its target
    dflash = DFlashDrafter(net, target)
    head = DominoHead(DominoConfig(target.hidden_size, target.vocab_size, gru_hidden_dim=16, emb_dim=8))
    with torch.no_grad():
        head.proj_out.weight.normal_(0, 0.5)  # a correction that changes drafts (zero init is the identity)
    draft_model = make_target("llama", seed=1, packed=True)  # same tokenizer, other weights
    cost = {k: 1e-3 * (1 + 0.1 * k) for k in (1, 2, 4, 8, 16, 32, 64)}
    from byblock.drafters.adaptive import CostModel

    return {
        "ngram": NgramDrafter(NgramConfig(block_size=4)),
        "ngramtree": NgramDrafter(NgramConfig(block_size=4, num_candidates=3, tree_budget=8)),
        "dflash": dflash,
        "ddtree": DDTreeDrafter(dflash.fork(), budget=8),
        "hybrid": HybridDrafter(NgramDrafter(NgramConfig(block_size=3)), DDTreeDrafter(dflash.fork(), budget=8), 10),
        "domino": DominoDrafter(dflash.fork(), head),
        "dominotree": DominoDrafter(dflash.fork(), head, tree_budget=6),
        "model": ModelDrafter(draft_model, target_vocab=target.vocab_size, block_size=3),
        "adaptive": AdaptiveDrafter(dflash.fork(), None, tree=True, max_budget=8, cost=CostModel(cost)),
    }


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3", "llama-int4"])
def setup(request):
    """(target, drafters) on the packed fp32 kernels; qwen3 has q/k norms, gemma3 sliding-window layers;
    llama-int4 runs the quantized kernels (kernels/quant_gemm.py), row-invariant like the packed ones."""
    arch, _, weights = request.param.partition("-")
    target = make_target(arch, packed=not weights, weights=weights or None)
    return target, _drafters(target)


def _solo(target, drafters, name, ids, params):
    base = drafters.get(name)
    return generate(target, ids, params, drafter=base.fork() if base is not None else None)


request_st = st.fixed_dictionaries(
    {
        "drafter": st.sampled_from(
            ["none", "ngram", "ngramtree", "dflash", "ddtree", "hybrid", "domino", "dominotree", "model", "adaptive"]
        ),
        "prompt_len": st.one_of(st.integers(1, 40), st.integers(60, 230)),  # long ones are chunked
        "seed": st.integers(0, 2**16),
        "max_new": st.integers(1, 24),
        "sampled": st.booleans(),
        "arrive": st.integers(0, 6),
        "abort": st.one_of(st.none(), st.integers(0, 10)),
        "stop": st.booleans(),
    }
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=6),
    max_seqs=st.integers(1, 5),
    budget=st.integers(8, 160),
    chunked=st.booleans(),
)
def test_random_mix_matches_solo(setup, reqs, max_seqs, budget, chunked):
    """Random requests arriving at random steps, some aborted, long prompts prefilled in chunks or whole:
    each finished one equals its solo run."""
    target, drafters = setup
    budget = max(budget, PREFILL_TILE) if chunked else budget
    config = BatchConfig(max_num_seqs=max_seqs, max_batched_tokens=budget, chunked_prefill=chunked)
    core = BatchedEngineCore(target, drafters, config)
    arrivals: dict[int, list[EngineRequest]] = {}
    aborts: dict[int, list[str]] = {}
    expected = {}
    for i, r in enumerate(reqs):
        # The adaptive drafter sizes drafts from measured times and a sampled verify draws per drafted node, so its
        # sampled output is reproducible in law only, alone as much as batched: greedy for it.
        sampled = r["sampled"] and r["drafter"] != "adaptive"
        g = torch.Generator().manual_seed(r["seed"])
        ids = torch.randint(3, target.vocab_size, (r["prompt_len"],), generator=g).tolist()
        params = SamplingParams(
            max_new_tokens=r["max_new"],
            temperature=0.8 if sampled else 0.0,
            top_k=20 if sampled else 0,
            seed=r["seed"],
            stop=("e",) if r["stop"] else (),
        )
        rid = f"r{i}"
        arrivals.setdefault(r["arrive"], []).append(EngineRequest(rid, tuple(ids), params, r["drafter"]))
        if r["abort"] is not None:
            aborts.setdefault(r["arrive"] + r["abort"], []).append(rid)
        expected[rid] = (r["drafter"], ids, params)
    results, texts, _ = drive(core, arrivals, aborts)
    for rid, (name, ids, params) in expected.items():
        if rid not in results:  # aborted before it finished
            continue
        solo = _solo(target, drafters, name, ids, params)
        got = results[rid]
        assert got.token_ids == solo.token_ids, (rid, name, params)
        assert got.text == solo.text == texts.get(rid, "")
        assert got.finish_reason == solo.finish_reason
    assert not core.has_unfinished() and core.num_running() == 0


def test_every_drafter_batched_together(setup):
    """One request per drafter (greedy and sampled), all in the same forwards, each equal to its solo run."""
    target, drafters = setup
    core = BatchedEngineCore(target, drafters, BatchConfig(max_num_seqs=32))
    names = ["none", *drafters]
    arrivals = {0: []}
    cases = {}
    for i, name in enumerate(names):
        for sampled in (False, True) if name != "adaptive" else (False,):  # see test_random_mix_matches_solo
            ids = target.encode_prompt(REPETITIVE if i % 2 else "def add(a, b):", chat=True)
            params = SamplingParams(max_new_tokens=20, temperature=0.9 if sampled else 0.0, seed=i, ignore_eos=True)
            rid = f"{name}-{sampled}"
            arrivals[0].append(EngineRequest(rid, tuple(ids), params, name))
            cases[rid] = (name, ids, params)
    results, _, widest = drive(core, arrivals, {})
    assert widest == len(cases)  # they really shared forwards
    for rid, (name, ids, params) in cases.items():
        assert results[rid].token_ids == _solo(target, drafters, name, ids, params).token_ids, rid
    assert any(results[f"{n}-False"].stats.mean_accepted > 1 for n in drafters)  # drafts were accepted


def test_preemption_recomputes_and_stays_lossless(setup):
    """A KV budget too small for the batch preempts; preempted requests finish with the right tokens."""
    target, drafters = setup
    core = BatchedEngineCore(target, drafters, BatchConfig(max_num_seqs=4, max_kv_tokens=70))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = [target.encode_prompt(p, chat=False) for p in ("def add(a, b):", REPETITIVE, "for i in", "Question:")]
    arrivals = {0: [EngineRequest(f"p{i}", tuple(ids), params, "dflash") for i, ids in enumerate(prompts)]}
    results, _, _ = drive(core, arrivals, {})
    assert core.preemptions > 0
    # Recomputed K/V come from one prefill instead of the rounds that made them: equal in law, and on these
    # models (no fp32 near-ties) the same greedy tokens.
    for i, ids in enumerate(prompts):
        assert results[f"p{i}"].token_ids == _solo(target, drafters, "dflash", ids, params).token_ids


def test_packed_forward_is_bitwise_the_solo_forward(setup):
    """The packed forward's logits and caches equal each sequence's own forward bit for bit: a prompt, a plain
    step, a chain and a tree in one forward."""
    target, _ = setup
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in (20, 33, 12))
    solo = [target.new_cache() for _ in range(3)]
    packed = [target.new_cache() for _ in range(3)]
    for caches in (solo[:2], packed[:2]):
        target.forward(torch.tensor([a]), caches[0])
        target.forward(torch.tensor([b]), caches[1])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    pos = solo[0].next_position + torch.tensor([0, 1, 1, 1])
    want = [
        target.forward(torch.tensor([[3, 4, 5, 6]]), solo[0], positions=pos[None], tree_mask=tree).logits[0],
        target.forward(torch.tensor([[6, 7, 8]]), solo[1]).logits[0],
        target.forward(torch.tensor([c]), solo[2]).logits[0],
    ]
    segs = [
        SegmentInput(packed[0], [3, 4, 5, 6], pos, tree),
        SegmentInput(packed[1], [6, 7, 8]),
        SegmentInput(packed[2], c),
    ]
    out = target.forward_packed(segs, list(range(4 + 3 + len(c))))
    assert torch.equal(out.logits, torch.cat(want))
    for s, p in zip(solo, packed, strict=True):
        assert torch.equal(s.pos, p.pos)
        for ls, lp in zip(s.hf.layers, p.hf.layers, strict=True):
            assert torch.equal(ls.keys, lp.keys) and torch.equal(ls.values, lp.values)


def test_generate_list_api(setup):
    """generate(model, [prompts], [params]) returns one result per prompt, in order, equal to solo runs."""
    target, drafters = setup
    prompts = ["def add(a, b):", REPETITIVE, [5, 6, 7, 8]]
    params = [SamplingParams(max_new_tokens=n, seed=n, temperature=t) for n, t in ((10, 0.0), (12, 0.7), (8, 0.0))]
    results = generate(target, prompts, params, drafter=drafters["ddtree"])
    for p, sp, res in zip(prompts, params, results, strict=True):
        assert res.token_ids == generate(target, p, sp, drafter=drafters["ddtree"].fork()).token_ids
    with pytest.raises(ValueError, match="2 SamplingParams"):
        generate(target, prompts, params[:2])


def test_batched_drafter_forward_is_bitwise_each_forks_own(setup):
    """draft_blocks: several forks' DFlash blocks in one drafter forward equal each fork's own forward."""
    from byblock.drafters.dflash import draft_blocks

    target, drafters = setup
    base = drafters["dflash"]
    params = SamplingParams()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in (9, 17, 4)]
    solo, batched = [], []
    for ids in prompts:
        out = target.forward(torch.tensor([ids]), target.new_cache(), hidden_layers=base.hidden_layers)
        for group in (solo, batched):
            fork = base.fork()
            fork.start(ids, out.hidden, params, None)
            group.append(fork)
    rows = (None, 4, 6)  # the drafter's own block, and shorter ones (adaptive drafters draft short blocks in a batch)
    want = [d.draft_logits(5, len(ids), 3, rows=n) for d, ids, n in zip(solo, prompts, rows, strict=True)]
    draft_blocks([(d, 5, len(ids), 3, n) for d, ids, n in zip(batched, prompts, rows, strict=True)])
    for d, s, ids, w, n in zip(batched, solo, prompts, want, rows, strict=True):
        assert torch.equal(d.draft_logits(5, len(ids), 3, rows=n), w)
        assert d._cache.length == s._cache.length == len(ids)
        for i in range(len(d.model.layers)):  # the same context K/V per layer
            assert all(torch.equal(a, b) for a, b in zip(d._cache.layer(i), s._cache.layer(i), strict=True))


def test_quantized_kv_cache_batched_matches_solo():
    """An int8 KV cache (kv/kv_quant.py) appends per request in the packed forward exactly as alone."""
    target = make_target("llama", packed=True)
    target.kv_bits = 8
    prompts = ["def add(a, b):", REPETITIVE, "for i in range(10):"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    drafter = NgramDrafter(NgramConfig(block_size=4))
    solo = [generate(target, p, params, drafter=drafter).token_ids for p in prompts]
    assert [r.token_ids for r in generate(target, prompts, params, drafter=drafter)] == solo


def test_chunked_prefill_is_bitwise_one_prefill(setup):
    """A prompt prefilled in tile-aligned chunks leaves the same cache and logits, bit for bit, as one
    prefill forward (kernels/gqa_sdpa.py's aligned query tiles; the chunks say they are a prompt's)."""
    target, _ = setup
    ids = torch.randint(3, target.vocab_size, (230,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = target.new_cache()
    ref = target.forward_packed([SegmentInput(whole, ids)], [229]).logits
    for cuts in ((64,), (128, 192), (64, 128, 192)):
        cache, edges = target.new_cache(), (0, *cuts, len(ids))
        for a, b in itertools.pairwise(edges):
            other = target.new_cache()  # another request in the same forward: its rows must not matter
            segs = [SegmentInput(cache, ids[a:b], prompt=True), SegmentInput(other, ids[:7], prompt=True)]
            out = target.forward_packed(segs, [b - a - 1])
        assert torch.equal(out.logits, ref), cuts
        for layer in range(len(whole.hf.layers)):
            k_ref, v_ref = whole.hf.layers[layer].keys, whole.hf.layers[layer].values
            assert torch.equal(cache.hf.layers[layer].keys, k_ref), (cuts, layer)
            assert torch.equal(cache.hf.layers[layer].values, v_ref), (cuts, layer)


def test_long_prompt_is_chunked_beside_decoding_requests(setup):
    """With a small row budget a long prompt is prefilled over several steps while the running requests keep
    decoding every step; every request equals its solo run."""
    target, drafters = setup
    core = BatchedEngineCore(target, drafters, BatchConfig(max_num_seqs=4, max_batched_tokens=128))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    short = target.encode_prompt("def add(a, b):", chat=False)
    long = torch.randint(3, target.vocab_size, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    arrivals = {0: [EngineRequest("short", tuple(short), params, "dflash")]}
    arrivals[1] = [EngineRequest("long", tuple(long), params, "ddtree")]
    steps_with_both, results = 0, {}
    core.add_request(arrivals[0][0])
    step = 0
    while core.has_unfinished() or step <= 1:
        if step == 1:
            core.add_request(arrivals[1][0])
        outs = core.step()
        results.update({o.request_id: o.result for o in outs if o.result is not None})
        assert all(o.error is None for o in outs)
        steps_with_both += core.last_step.seqs == 2 and core.last_step.prefills == 1
        step += 1
    assert steps_with_both >= 3  # the 200-token prompt took 64 + 64 + 64 + 8 rows, beside decode rounds
    assert results["short"].token_ids == _solo(target, drafters, "dflash", short, params).token_ids
    assert results["long"].token_ids == _solo(target, drafters, "ddtree", long, params).token_ids


def test_bf16_row_invariant_chunked_prefill_runs():
    """Regression: a prefill chunk needs no logits, so the bf16 row-invariant LM head gets zero rows."""
    target = make_target("llama", dtype=torch.bfloat16, row_invariant=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (100, 5, 130)]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    results = generate(target, prompts, params, batch=BatchConfig(max_batched_tokens=64))
    assert [len(r.token_ids) for r in results] == [6, 6, 6]


def test_batched_adaptive_drafts_short_blocks_and_stays_exact():
    """With other requests in the forward an adaptive drafter asks its backbone for BATCHED_ROWS positions, not its
    trained block (alone: the whole block); every request's batched output is still its plain output."""
    from byblock.drafters.adaptive import BATCHED_ROWS, CostModel
    from byblock.kernels.packed_gemm import load_kernel, pack_linears

    target = make_target("llama", packed=True)
    net = make_dflash(target, block=12)
    pack_linears(net, load_kernel())
    cheap = CostModel({1: 1e-3, 64: 1.5e-3})  # verify rows almost free: the drafter always drafts
    base = AdaptiveDrafter(DFlashDrafter(net, target), None, tree=True, max_budget=12, cost=cheap)
    d = base.fork()
    prompt = [5, 17, 33, 9]
    out = target.forward(torch.tensor([prompt]), target.new_cache(), hidden_layers=d.hidden_layers)
    d.start(prompt, out.hidden, SamplingParams(), None)
    assert d.block_request([*prompt, 40], 11)[1:] == (11, None)  # alone: the trained block
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.0)
    assert d.block_request([*prompt, 40], 11)[1:] == (BATCHED_ROWS - 1, BATCHED_ROWS)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = ["def add(a, b):", REPETITIVE, "for i in range(10):"]
    plain = [generate(target, p, params).token_ids for p in prompts]
    assert [r.token_ids for r in generate(target, prompts, params, drafter=base)] == plain
