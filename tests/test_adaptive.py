"""Adaptive budgets: the cost model and the choice rule; lossless whatever it picks."""

from __future__ import annotations

import pytest
import torch
from lossless import SAMPLING_ALPHA, greedy_outputs_match, sampling_pvalue
from tiny import make_dflash, make_target

from byblock import SamplingParams
from byblock.drafters import DrafterSpec
from byblock.drafters.adaptive import AdaptiveDrafter, CostModel, measure_verify_cost
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.errors import ByblockError
from byblock.verify.types import Verdict


def test_cost_model_interpolates():
    c = CostModel({1: 1.0, 4: 2.5, 16: 4.0})
    assert c(1) == 1.0 and c(2) == pytest.approx(1.5) and c(10) == pytest.approx(3.25) and c(32) == 8.0


def test_cost_model_memo_gives_the_interpolation():
    """cost(k) is memoised per row count: repeated and interleaved asks give the interpolated value itself."""
    c = CostModel({1: 1.0, 4: 2.5, 16: 4.0, 33: 9.0})
    fresh = [CostModel({1: 1.0, 4: 2.5, 16: 4.0, 33: 9.0})._interpolate(k) for k in range(0, 70)]
    for k in [*range(70), *reversed(range(70))]:
        assert c(k) == fresh[k]


def test_path_probs_are_the_product_along_each_path():
    """The tree rule's Π p̂ per node (one gather, host floats) against the product read node by node."""
    from byblock.drafters.ddtree import build_tree

    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(6, 50, generator=g), -1)
    ids, parents = build_tree(logp, 20)
    probs, depth = AdaptiveDrafter._path_probs(logp, ids, parents)
    for i in range(len(ids)):
        want, node = 1.0, i
        while node >= 0:
            want *= float(logp[depth[node], ids[node]].exp())
            node = parents[node]
        assert probs[i] == pytest.approx(want, rel=1e-5)
    assert AdaptiveDrafter._path_probs(logp, [], []) == ([], [])


def test_measured_costs_are_positive(tiny_targets):
    costs = measure_verify_cost(tiny_targets["llama"], sizes=(1, 4), context=16, repeats=1)
    assert set(costs) == {1, 4} and all(v > 0 for v in costs.values())


def _adaptive(target, cost, tree=False):
    return AdaptiveDrafter(DFlashDrafter(make_dflash(target, block=8), target), target, tree=tree, cost=cost)


def test_chain_depth_follows_acceptance_and_cost(tiny_targets):
    target = tiny_targets["llama"]
    flat = CostModel({1: 1.0, 64: 1.0})  # verification is free: draft as deep as possible
    steep = CostModel({1: 1.0, 2: 2.0, 64: 64.0})  # every token costs a full step: never draft
    for cost, want in ((flat, 7), (steep, 0)):
        d = _adaptive(target, cost)
        d.rounds, d.probes[0].resting_for = 1, 0  # not the first round: neither a whole-block exploration nor a probe
        d.start(
            [5, 17, 33, 9],
            target.forward(torch.tensor([[5, 17, 33, 9]]), target.new_cache(), hidden_layers=d.hidden_layers).hidden,
            SamplingParams(),
            None,
        )
        d.propose([5, 17, 33, 9, 40], 7)
        assert d.last_choice == want


def _bare_chain_drafter() -> AdaptiveDrafter:
    """An adaptive chain over a 4-token block with prior-only statistics and a backbone that ignores verdicts."""
    d = AdaptiveDrafter.__new__(AdaptiveDrafter)
    d.block_size, d.tree = 4, False
    d.accepted_at, d.reached = [1.0] * 4, [2.0] * 4
    d.look_accepted, d.look_reached = [1.0] * 4, [2.0] * 4
    d.rho_num = d.rho_den = 1.0
    d._depth = 4
    d.dflash = type("D", (), {"observe": lambda self, v, h: None})()
    return d


def test_acceptance_statistics_update():
    d = _bare_chain_drafter()
    d.observe(Verdict(path=[0, 1], tokens=[3, 4, 5]), None)  # accepted 2 of 4
    assert d.accepted_at == [2, 2, 1, 1] and d.reached == [3, 3, 3, 2]


def test_acceptance_statistics_forget_old_turns():
    """100 rounds that accept everything, then 40 that accept nothing: depth-1 acceptance must have followed
    (pooled counts would still say 101/142 = 0.71)."""
    d = _bare_chain_drafter()
    for _ in range(100):
        d.observe(Verdict(path=[0, 1, 2, 3], tokens=[3, 4, 5, 6, 7]), None)
    assert d.accepted_at[0] / d.reached[0] > 0.9
    for _ in range(40):
        d.observe(Verdict(path=[], tokens=[3]), None)
    assert d.accepted_at[0] / d.reached[0] < 0.25


def test_chain_rests_when_no_depth_beats_a_plain_step(tiny_targets):
    """Verifying costs 3 plain steps per extra token: the rule skips the drafter (plain steps) except on probes
    (the first round, then after 15 resting rounds), which draft only the best depth, not the whole block."""
    target = tiny_targets["llama"]
    d = _adaptive(target, CostModel({1: 1.0, 2: 4.0, 64: 190.0}))
    calls = []
    draft_logits = d.dflash.draft_logits
    d.dflash.draft_logits = lambda *a, **k: calls.append(a[2]) or draft_logits(*a, **k)
    prompt = [5, 17, 33, 9]
    hidden = target.forward(torch.tensor([prompt]), target.new_cache(), hidden_layers=d.hidden_layers).hidden
    d.start(prompt, hidden, SamplingParams(), None)
    drafts = [d.propose([*prompt, 40], 7) for _ in range(8)]
    assert calls == [1] and drafts[0].num_nodes == 1  # round 0 explores at the best depth
    assert all(x.num_nodes == 0 for x in drafts[1:]) and d.last_choice == 0 and d.drafted == 1


def _counted_and_started(d: AdaptiveDrafter, target) -> tuple[list, list[int]]:
    """Count the drafter's forwards (their depths) and start a request on a prompt where "5, 17, 33" repeats
    (the lookup proposes "9, 40, ..." after the returned context)."""
    calls: list = []
    draft_logits = d.dflash.draft_logits
    d.dflash.draft_logits = lambda *a, **k: calls.append(a[2]) or draft_logits(*a, **k)
    prompt = [5, 17, 33, 9, 40, 5, 17]
    hidden = target.forward(torch.tensor([prompt]), target.new_cache(), hidden_layers=d.hidden_layers).hidden
    d.start(prompt, hidden, SamplingParams(), None)
    return calls, [*prompt, 33]


def test_tree_rests_when_no_tree_beats_not_drafting(tiny_targets):
    """Each extra verify row costs 3 plain steps: after its first round the tree skips the drafter for 7 rounds,
    then probes."""
    target = tiny_targets["llama"]
    d = AdaptiveDrafter(
        DFlashDrafter(make_dflash(target, block=8), target),
        target,
        tree=True,
        cost=CostModel({1: 1.0, 2: 4.0, 64: 190.0}),
    )
    calls, tokens = _counted_and_started(d, target)
    drafts = [d.propose(tokens, 7) for _ in range(9)]
    assert len(calls) == 2 and d.drafted == 2  # rounds 0 and 8
    assert all(x.num_nodes == 0 for x in drafts[1:8]) and drafts[0].num_nodes > 0


def _hybrid_on_repeat(target):
    """An adaptive hybrid whose lookup proposes "9, 40, ..." for the context below, a fake clock, and a backbone
    that ignores verdicts."""
    d = AdaptiveDrafter(
        DFlashDrafter(make_dflash(target, block=8), target),
        target,
        tree=True,
        max_budget=12,
        cost=CostModel({1: 100.0, 64: 200.0}),
        lookup=NgramDrafter(NgramConfig(block_size=5)),
    )
    calls, tokens = _counted_and_started(d, target)
    d.dflash.observe = lambda verdict, hidden: None
    return d, calls, tokens


def _rounds(d, calls, tokens, n, drafted=(1.0, 3), rested=(1.0, 3)) -> list[bool]:
    """n rounds on a fake clock: a drafting round takes drafted[0] seconds and emits drafted[1] tokens, a resting
    one rested[0] and rested[1]. Returns which rounds drafted."""
    now = [0.0]
    d.clock = lambda: now[0]
    out = []
    for _ in range(n):
        before = len(calls)
        d.propose(tokens, 7)
        out.append(len(calls) > before)
        seconds, emitted = drafted if out[-1] else rested
        now[0] += seconds
        d.observe(Verdict(path=list(range(emitted - 1)), tokens=list(range(emitted))), None)
    return out


def test_hybrid_rests_while_resting_rounds_emit_more_per_second(tiny_targets):
    """Drafting rounds take 3 s for 3 tokens, resting ones 1 s for 3: after measuring both arms the hybrid rests,
    probing the drafter at growing gaps; the resting rounds verify the lookup chain (cut by the rule)."""
    d, calls, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    drafted = _rounds(d, calls, tokens, 200, drafted=(3.0, 3), rested=(1.0, 3))
    assert sum(drafted) <= 12 and all(drafted[:3])
    gaps = [b - a for a, b in zip(*[[i for i, x in enumerate(drafted) if x][k:] for k in (0, 1)], strict=False)]
    assert gaps[-2:] == [64, 64]  # the probe gap grew to its cap
    draft = d.propose(tokens, 7)
    assert draft.is_chain and draft.tokens[:2].tolist() == [9, 40]


def test_hybrid_keeps_drafting_while_drafting_rounds_pay(tiny_targets):
    """Drafting rounds: 1 s for 6 tokens; resting: 1 s for 2. After measuring resting once, it drafts every round."""
    d, calls, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    drafted = _rounds(d, calls, tokens, 40, drafted=(1.0, 6), rested=(1.0, 2))
    assert 1 <= drafted.count(False) <= 4 and all(drafted[-30:])


def test_hybrid_resumes_drafting_when_its_probes_pay(tiny_targets):
    d, calls, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    _rounds(d, calls, tokens, 30, drafted=(3.0, 3), rested=(1.0, 3))  # resting wins ...
    drafted = _rounds(d, calls, tokens, 60, drafted=(1.0, 9), rested=(1.0, 3))  # ... until drafting is 3x better
    assert all(drafted[-12:])


def test_hybrid_rest_with_a_lookup_chain_does_not_park_the_model_without_one(tiny_targets):
    """Resting wins where the lookup proposes a chain; where it finds no match (a separate regime with its own
    arms) the model still drafts."""
    d, calls, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    _rounds(d, calls, tokens, 30, drafted=(3.0, 3), rested=(1.0, 3))
    assert not d.hybrid_model_pays(1)
    no_match = [*tokens[:-1], 99]  # "17, 99" never occurred: the lookup proposes nothing
    drafted = _rounds(d, calls, no_match, 12, drafted=(1.0, 2), rested=(1.0, 1))
    assert drafted[:3] == [True, True, True] and all(drafted[-6:]) and d.hybrid_model_pays(0)


def test_batched_hybrid_charges_its_drafter_when_deciding_to_run_it(tiny_targets):
    """Batched, the hybrid decides from the forward's tokens per second whether the next round runs the drafter.
    Once the drafter's own time is spent every tree option pays it, so the choice must be held against the lookup
    chain without it: a drafter costing 100 forwards is parked, a free one is not."""
    d, _, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.0)  # three other requests, one row each
    d.cost = CostModel({1: 100.0, 64: 100.01})  # verify rows all but free: any node with a chance pays
    d.rho_num = d.rho_den = 1.0
    look = d.lookup.propose(tokens, 7)
    logits = d.dflash.draft_logits(tokens[-1], len(tokens) - 1, 7)
    d._hybrid(look, logits, draft_s=0.0)
    assert d.hybrid_model_pays(1)  # free drafting: the model's nodes add tokens
    d._hybrid(look, logits, draft_s=1e4)  # a drafter 100x the forward's cost
    assert not d.hybrid_model_pays(1)


def test_batched_decisions_charge_a_backbone_rounds_extra_finishing(tiny_targets):
    """The batched engine reports what finishing each round cost (observe_host); a batched decision adds what a
    backbone round costs beyond another round to the drafter's time, and nothing until both kinds were seen or
    when the request runs alone."""
    d, _, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.0)
    base = d._decide(tokens, 7).draft_s
    d._backbone_ran = True
    d.observe_host(0.5)
    assert d._decide(tokens, 7).draft_s == pytest.approx(base)  # no lookup-only round measured yet
    d._backbone_ran = False
    d.observe_host(0.2)
    d.observe_host(0.2)
    assert d._decide(tokens, 7).draft_s == pytest.approx(base + 0.3)
    d._backbone_ran = True
    d.observe_host(1.5)  # a running mean: 0.9 * 0.5 + 0.1 * 1.5
    assert d._decide(tokens, 7).draft_s == pytest.approx(base + 0.4)
    d.set_batch_load(rows=0, tokens=0.0, seconds=0.0)  # alone: the hybrid's clock already times whole rounds
    assert d._decide(tokens, 7).draft_s == pytest.approx(base)


def test_resting_hybrid_cuts_the_lookup_chain_to_its_profitable_length(tiny_targets):
    """Lookup acceptance β ≈ 0 and a verify row costing a plain step: a resting round is a plain step."""
    d, calls, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    d.cost = CostModel({1: 100.0, 2: 200.0, 64: 6400.0})
    d.look_accepted = [1.0] * len(d.look_accepted)
    d.look_reached = [100.0] * len(d.look_reached)
    d.probes[1].resting_for = 0  # not the first round (which would probe)
    d.hybrid_model_pays = lambda regime: False
    draft = d.propose(tokens, 7)
    assert draft.num_nodes == 0 and not calls and d.rests == 1


@pytest.mark.parametrize("kind", ["chain", "tree", "hybrid", "resting chain", "resting tree", "resting hybrid"])
def test_adaptive_is_lossless(tiny_target, kind):
    lookup = NgramDrafter(NgramConfig(block_size=5)) if "hybrid" in kind else None
    steep = CostModel({1: 1.0, 2: 2.5, 16: 40.0})  # mostly plain steps, a 1-token chain every 8th round
    drafter = AdaptiveDrafter(
        DFlashDrafter(make_dflash(tiny_target, block=6), tiny_target),
        tiny_target,
        tree="tree" in kind or "hybrid" in kind,
        max_budget=12,
        cost=steep if kind.startswith("resting") else CostModel({1: 1.0, 4: 1.2, 16: 2.0}),
        lookup=lookup,
    )
    if kind == "resting hybrid":  # the model part rests except on probes; lookup chains cut by the rule
        drafter.hybrid_model_pays = lambda regime: False
    for prompt in ([5, 17, 33, 9], [7, 7, 7, 7, 7, 7, 12, 40], [5, 17, 33, 9, 40, 41, 5, 17, 33]):
        greedy_outputs_match(tiny_target, prompt, SamplingParams(max_new_tokens=40), drafter)


def test_adaptive_hybrid_sampling_matches_target_distribution():
    """Temperature 1: the hybrid's merged trees and its resting rounds (the lookup chain alone, cut by the rule;
    the tiny drafter rarely pays, so both kinds occur) leave the law of the first 4 tokens unchanged."""
    target = make_target("llama")
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4)
    prompt = [5, 17, 33, 9, 5, 17]
    drafter = AdaptiveDrafter(
        DFlashDrafter(make_dflash(target, block=4), target),
        target,
        tree=True,
        max_budget=8,
        cost=CostModel({1: 1.0, 4: 1.2, 16: 2.0}),
        lookup=NgramDrafter(NgramConfig(block_size=3)),
    )
    # A fake clock, so which rounds rest does not depend on the host's speed: each reading is a second later and
    # a drafter forward costs three more (the tiny drafter rarely pays).
    now = [0.0]

    def tick() -> float:
        now[0] += 1.0
        return now[0]

    draft_logits = drafter.dflash.draft_logits

    def slow_draft(*args, **kwargs):
        now[0] += 3.0
        return draft_logits(*args, **kwargs)

    drafter.clock, drafter.dflash.draft_logits = tick, slow_draft
    assert sampling_pvalue(target, drafter, prompt, params) > SAMPLING_ALPHA
    assert drafter.rests > 1000 and drafter.drafted > 30


def test_adaptive_hybrid_learns_lookup_acceptance(tiny_targets):
    target = tiny_targets["llama"]
    free = CostModel({1: 1.0, 64: 1.0})
    d = AdaptiveDrafter(
        DFlashDrafter(make_dflash(target, block=6), target),
        target,
        tree=True,
        cost=free,
        lookup=NgramDrafter(NgramConfig(block_size=5)),
    )
    prompt = [5, 17, 33, 9, 40, 41, 5]
    d.start(
        prompt,
        target.forward(torch.tensor([prompt]), target.new_cache(), hidden_layers=d.hidden_layers).hidden,
        SamplingParams(),
        None,
    )
    draft = d.propose([*prompt, 17], 5)  # lookup continues "5 17" with "33 9 40"
    assert draft.tokens[:3].tolist() == [33, 9, 40] and draft.parents[:3].tolist() == [-1, 0, 1]
    assert d.last_choice == draft.num_nodes  # free verification: every model node is worth adding
    d.dflash.observe = lambda verdict, hidden: None
    d.observe(Verdict(path=[0, 1], tokens=[33, 9, 7]), None)  # lookup right twice, then wrong
    assert d.look_accepted[:3] == [2, 2, 1] and d.look_reached[:4] == [3, 3, 3, 2]


def test_adaptive_flag_needs_a_block_drafter():
    with pytest.raises(ByblockError, match="--adaptive"):
        DrafterSpec.parse("ngram", adaptive=True)
    assert DrafterSpec.parse("hybrid", adaptive=True).adaptive
