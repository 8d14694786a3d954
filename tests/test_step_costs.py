"""The batched engine's fit of its own step costs (engine/step_costs.py) and how adaptive drafters use it."""

from __future__ import annotations

import random

import pytest

from byblock.drafters.costs import CostModel, StepCost
from byblock.engine.step_costs import READY_STEPS, StepCostFit

TRUE = (8e-3, 4e-4, 7e-4, 6e-4, 2e-4)  # fixed, per_seq, per_row, per_prefill, per_verify


def _step(rng: random.Random) -> tuple[int, int, int, int]:
    seqs = rng.randint(1, 8)
    verifying = rng.randint(0, seqs)
    decode = seqs + sum(rng.randint(1, 6) for _ in range(verifying))
    prefill = rng.choice([0, 0, 0, rng.randint(10, 200)])
    return seqs, decode, prefill, verifying


def _seconds(shape: tuple[int, int, int, int], coef=TRUE) -> float:
    return coef[0] + sum(c * x for c, x in zip(coef[1:], shape, strict=True))


def test_the_fit_recovers_a_linear_step_cost():
    """Steps of varied shapes, noiseless, from a wrong prior: every fitted price ends at least twice as near the
    true one as the prior was (the ridge keeps some of the prior by design, most where prices are correlated:
    verifying rounds bring their rows), and the step seconds are predicted."""
    rng = random.Random(0)
    prior = (1.2e-2, 0.0, 1e-3, 1e-3, 0.0)
    fit = StepCostFit(prior)
    assert not fit.ready
    for _ in range(400):
        shape = _step(rng)
        fit.add(_seconds(shape), *shape)
    assert fit.ready
    for got, want, was in zip(fit.coef, TRUE, prior, strict=True):
        assert abs(got - want) <= 0.5 * abs(was - want) + 1e-6
    for _ in range(20):
        shape = _step(rng)
        assert _seconds(shape, fit.coef) == pytest.approx(_seconds(shape), rel=0.05)


def test_a_price_the_steps_cannot_separate_stays_at_its_prior():
    """Every request resting (decode rows = requests): per_row and per_seq are not identifiable apart; their sum
    is fitted, and the split stays near the prior instead of wandering (or going negative)."""
    prior = (8e-3, 4e-4, 7e-4, 6e-4, 0.0)
    fit = StepCostFit(prior)
    rng = random.Random(1)
    for _ in range(300):
        seqs = rng.randint(2, 6)
        fit.add(8e-3 + 1.1e-3 * seqs, seqs, seqs, 0, 0)
    _, per_seq, per_row, _, per_verify = fit.coef
    assert per_seq + per_row == pytest.approx(1.1e-3, rel=0.02)
    assert per_row == pytest.approx(7e-4, rel=0.15) and per_verify == pytest.approx(0.0, abs=1e-5)
    assert min(fit.coef) >= 0


def test_a_request_sees_the_step_without_its_round():
    fit = StepCostFit(TRUE)
    cost = fit.for_request(seqs=4, other_rows=6, other_verifying=2, other_draft_s=1e-3)
    assert cost.base_s == pytest.approx(TRUE[0] + 4 * TRUE[1] + 6 * TRUE[2] + 2 * TRUE[4] + 1e-3)
    assert cost.seconds(1) == pytest.approx(cost.base_s + TRUE[2])  # a plain step: one row, no verify
    assert cost.seconds(4) == pytest.approx(cost.base_s + 4 * TRUE[2] + TRUE[4])


def test_step_costs_are_validated():
    with pytest.raises(ValueError, match="non-negative"):
        StepCost(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        StepCostFit((1.0, 0.0, -1.0, 0.0, 0.0))
    with pytest.raises(ValueError):
        StepCostFit((1.0, 0.0))


def test_the_probed_curve_never_falls():
    """A noisy probe (24 rows measured cheaper than 16) must not make rows look free."""
    cost = CostModel({1: 9.0, 16: 20.9, 24: 20.5, 32: 27.7})
    assert cost(24) == cost(16) == 20.9 and cost(20) == 20.9 and cost.slope(16, 24) == 0.0
    assert cost(32) == 27.7


def test_batched_adaptive_rates_use_the_engines_prices(tiny_targets):
    """Handed the engine's StepCost, an adaptive drafter's rate is (others' tokens + its own) / (the step's
    seconds with its round + its drafting); without one it falls back to the probed cost(k)."""
    from test_adaptive import _hybrid_on_repeat

    d, _, _ = _hybrid_on_repeat(tiny_targets["llama"])
    d.cost = CostModel({1: 1.0, 64: 64.0})
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.5)
    assert d._rate(2.0, 3, 0.25) == pytest.approx(5.0 / (0.5 + 0.25 + 6.0))
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.5, cost=StepCost(base_s=2.0, per_row=0.5, per_verify=0.1))
    assert d._rate(2.0, 3, 0.25) == pytest.approx(5.0 / (2.0 + 1.5 + 0.1 + 0.25))
    assert d._rate(1.0, 1, 0.0) == pytest.approx(4.0 / 2.5)  # a plain step: no verify price


def test_the_engine_fits_its_steps_and_hands_drafters_its_prices(tiny_targets):
    """A batched run with an adaptive drafter feeds every step into the fit; once ready, drafters get StepCosts."""
    from tiny import make_dflash

    from byblock.drafters.adaptive import AdaptiveDrafter
    from byblock.drafters.dflash import DFlashDrafter
    from byblock.engine.api import generate
    from byblock.sampling.params import SamplingParams

    target = tiny_targets["llama"]
    cost = CostModel({1: 1e-3, 64: 4e-3})
    base = AdaptiveDrafter(DFlashDrafter(make_dflash(target), target), None, tree=True, max_budget=8, cost=cost)
    seen = []
    original = AdaptiveDrafter.set_batch_load

    def spy(self, rows, tokens, seconds, cost=None):
        seen.append(cost)
        original(self, rows, tokens, seconds, cost)

    AdaptiveDrafter.set_batch_load = spy
    try:
        params = SamplingParams(max_new_tokens=int(READY_STEPS) + 12, ignore_eos=True)
        prompts = [[5, 17, 33, 9], [7, 8, 9], [40, 41, 42, 43, 44]]
        plain = [generate(target, p, params).token_ids for p in prompts]
        batched = generate(target, prompts, params, drafter=base)
    finally:
        AdaptiveDrafter.set_batch_load = original
    assert [r.token_ids for r in batched] == plain
    assert seen and seen[0] is None and any(isinstance(c, StepCost) for c in seen)


def _run_gate(gate, drafting_rate: float, resting_rate: float, steps: int) -> list[bool]:
    """Feed a gate steps whose tokens per second depend on its mode; returns the mode of every step."""
    modes = []
    for _ in range(steps):
        modes.append(gate.drafts)
        gate.add(10, 10 / (drafting_rate if gate.drafts else resting_rate))
    return modes


def test_the_gate_runs_the_faster_mode_and_probes_the_other():
    """Drafting slower than resting: after one measured block of each, the gate rests, with one drafting block
    every GATE_PROBE_EVERY resting ones; drafting faster: it drafts, probing resting alike."""
    from byblock.engine.step_costs import GATE_BLOCK, GATE_PROBE_EVERY, DraftGate

    gate = DraftGate()
    modes = _run_gate(gate, drafting_rate=0.8, resting_rate=1.0, steps=GATE_BLOCK * 30)
    assert modes[:GATE_BLOCK] == [True] * GATE_BLOCK and modes[GATE_BLOCK : 2 * GATE_BLOCK] == [False] * GATE_BLOCK
    tail = modes[2 * GATE_BLOCK :]
    assert tail.count(True) / len(tail) == pytest.approx(1 / (GATE_PROBE_EVERY + 1), abs=0.05)
    assert gate.rate(False) > gate.rate(True)
    gate = DraftGate()
    modes = _run_gate(gate, drafting_rate=1.3, resting_rate=1.0, steps=GATE_BLOCK * 30)[2 * GATE_BLOCK :]
    assert modes.count(False) / len(modes) == pytest.approx(1 / (GATE_PROBE_EVERY + 1), abs=0.05)


def test_the_gate_follows_a_change():
    """Drafting pays, then stops paying (a turn of the conversation): the gate goes over to resting."""
    from byblock.engine.step_costs import GATE_BLOCK, DraftGate

    gate = DraftGate()
    _run_gate(gate, drafting_rate=1.5, resting_rate=1.0, steps=GATE_BLOCK * 20)
    late = _run_gate(gate, drafting_rate=0.5, resting_rate=1.0, steps=GATE_BLOCK * 40)[-GATE_BLOCK * 10 :]
    assert late.count(False) > late.count(True)


def test_a_gated_adaptive_drafter_takes_a_plain_step(tiny_targets):
    """StepCost(drafts=False): the round is a plain step (no backbone, no lookup chain), whatever would pay."""
    from test_adaptive import _hybrid_on_repeat

    d, _, tokens = _hybrid_on_repeat(tiny_targets["llama"])
    d.cost = CostModel({1: 1e-3, 64: 1.0001e-3})  # verify rows free: any draft would pay
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.0, cost=StepCost(1e-3, 0.0, 0.0, drafts=False))
    assert d.block_request(tokens, 7) is None
    assert d.propose(tokens, 7).num_nodes == 0
    d.set_batch_load(rows=3, tokens=3.0, seconds=0.0, cost=StepCost(1e-3, 0.0, 0.0, drafts=True))
    assert d.propose(tokens, 7).num_nodes > 0
