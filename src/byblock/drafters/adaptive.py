"""Adaptive block budget: each round, draft the size that maximises expected tokens per second.

The rule (measured costs, running acceptance):

    cost(k)   = seconds of one target forward over k new tokens, measured once on this machine (drafters/costs.py)
    draft     = running mean of the drafter's own time per round
    chain:    E(d) = 1 + Σ_{i=1..d} Π_{j=1..i} α_j     α_j = running acceptance at depth j given depth j−1
                                                        accepted (Beta(1,1)-smoothed counts)
    tree:     E(N) = 1 + ρ · Σ_{first N nodes} Π p̂     Π p̂ = the drafter's own path probability; ρ = running
                                                        ratio of accepted to predicted (calibration)
    hybrid:   E(N) = 1 + Σ_{j ≤ L} Π_{i ≤ j} β_i        the lookup chain (L tokens, always verified: it is free
                     + ρ · Σ_{first N model nodes off the lookup path} Π p̂    to draft) with its own running
                                                        per-depth acceptance β; tree size = L + new model nodes
    choose    argmax_d E(d) / (draft + cost(d+1))   (chain)   or   argmax_N E(N) / (draft + cost(size+1))   (tree)
    rest      (chain) when even the best depth is slower than a plain step, max_d E(d) / (draft + cost(d+1)) <
              1 / cost(1), the round skips the drafter and is one plain decoding step
              (tree) when the last drafted round's best tree was slower than a plain step, likewise. A tree's
              E(N) needs this round's drafter output, so a tree decides from the last drafted round, a chain
              from the running counts.
              (hybrid) a two-armed choice per regime, by the clock: tokens per wall second of past rounds
              that drafted vs of past rounds that rested (verified the lookup chain alone, cut to its best
              length by the chain rule on β, possibly 0: a plain step), each a forgetting sum (ARM_FORGET per
              round of that arm) over whole rounds, drafter + verify + commit + engine, from one propose to
              the next. Rest while the resting arm is faster. Rounds where the lookup proposes nothing and
              rounds where it proposes a chain are separate regimes (arms and probe schedules): without a
              chain the model competes with a plain step, which it beats far more often than a matched chain.
              Why the clock: rules on the cost model or on one round's prediction rested the model where it
              paid (dev/LOG.md sessions 11, 16, 17); the clock measures the whole round, not just the forward.
              Batched, a round's wall time is the whole forward's, so the hybrid instead drafts while its last
              best tree beat the lookup chain alone (without the drafter's time) in the forward's tokens/s.
    probe     a resting drafter drafts (probes) after 7 resting rounds, then after twice as many each time
              it is still unprofitable, up to MAX_PROBE_GAP: a probe costs a drafter forward and a verify, and
              with one every 8th round the resting hybrid's round cost at temperature 1 was 1.32 plain steps
              against lookup's 1.17 at the same τ (session 17). A chain's probe drafts only its best depth
              (on a CPU where a deep verify costs three plain steps, a whole-block probe would cost more than
              resting saves); a tree's re-decides whether its trees pay.

Every 8th round of a paying chain verifies the whole block, so acceptance at unused depths stays measured.
The counts behind α, β and ρ forget (weight FORGET per round, towards their prior): acceptance swings between
turns (a repetitive answer accepts whole blocks, the next one does not), and a rule that pooled all history
kept drafting deep after such a turn (dev/LOG.md, session 9).

A best-first tree's first N nodes are themselves a valid tree (parents are popped before children), so one
DDTree build serves every candidate N. The choice never affects correctness: verification is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from byblock.drafters.costs import COST_SIZES, CostModel, StepCost, measure_verify_cost, segment_cost
from byblock.drafters.ddtree import build_tree, tree_logp
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.hybrid import merge_trees
from byblock.drafters.ngram import NgramDrafter
from byblock.models.adapter import TargetModel
from byblock.models.devices import device_clock
from byblock.sampling.params import SamplingParams
from byblock.verify.types import Draft, Verdict

__all__ = ["BATCHED_ROWS", "COST_SIZES", "AdaptiveDrafter", "CostModel", "measure_verify_cost", "segment_cost"]

EXPLORE_EVERY = 8
FORGET = 0.95  # per round, the weight of older acceptance evidence (memory ~20 rounds: a turn is 50-100)
# hybrid: per round of an arm, the weight of that arm's older rounds. Faster than FORGET because while resting
# the drafting arm is only updated by probes: a few good probes end a rest.
ARM_FORGET = 0.8
ARM_EVIDENCE = 2.0  # hybrid: compare the arms once each has this much (forgetting-weighted) evidence
MAX_PROBE_GAP = 63  # at most this many resting rounds between two probes
# Backbone block positions when batched: at 4 requests a 16-position block cost 1.7 ms per request, the trees it
# fed stayed within depth 7, and an 8-position block gave as many accepted tokens (dev/LOG.md, session 34).
BATCHED_ROWS = 8
# Batched: per round of a kind, the weight of older measurements of finishing a round (observe_host)
HOST_FORGET = 0.9


class RoundRate:
    """Forgetting sums of tokens emitted and wall seconds spent by one arm's rounds (ARM_FORGET per round)."""

    def __init__(self) -> None:
        self.tokens, self.seconds, self.weight = 0.0, 0.0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One more round of this arm."""
        self.tokens = ARM_FORGET * self.tokens + tokens
        self.seconds = ARM_FORGET * self.seconds + seconds
        self.weight = ARM_FORGET * self.weight + 1

    def rate(self) -> float:
        """Tokens per second."""
        return self.tokens / max(self.seconds, 1e-12)


class ProbeSchedule:
    """When a resting drafter drafts again: after `gap` resting rounds, the gap doubling (up to MAX_PROBE_GAP)
    while drafting stays unprofitable. It starts due, so the first unprofitable round probes."""

    def __init__(self) -> None:
        self.gap = EXPLORE_EVERY - 1  # resting rounds before the next probe
        self.resting_for = EXPLORE_EVERY - 1  # resting rounds since the last drafted one

    def rests_now(self, pays: bool) -> bool:
        """Whether this round rests: not while drafting pays, and not on a probe."""
        if pays:
            self.gap, self.resting_for = EXPLORE_EVERY - 1, 0
            return False
        if self.resting_for < self.gap:
            self.resting_for += 1
            return True
        self.gap = min(2 * self.gap + 1, MAX_PROBE_GAP)  # for the next probe, if this one fails too
        self.resting_for = 0
        return False

    def bring_forward(self) -> None:
        """The next probe comes after the shortest gap again."""
        self.gap = EXPLORE_EVERY - 1


def expected_tokens(accept: list[float]) -> list[float]:
    """E(d) for d = 0..len(accept): tokens a round emits with a depth-d chain whose depth-j token is accepted
    with probability accept[j−1] given its parent was, 1 + Σ_{i ≤ d} Π_{j ≤ i} accept_j (host floats: the
    rule runs per request and round, where a few tensor ops cost more than the whole loop)."""
    expected, run = [1.0], 1.0
    for a in accept:
        run *= a
        expected.append(expected[-1] + run)
    return expected


def _toward(counts: list[float], prior: float) -> list[float]:
    """Counts shrunk towards their prior by FORGET."""
    return [prior + FORGET * (c - prior) for c in counts]


@dataclass(frozen=True)
class _Decision:
    """One round's choice, made before the backbone runs (so the batched engine can batch it)."""

    context: int  # len(tokens) it was made for
    depth: int  # backbone depth to draft; 0: rest
    look: Draft | None  # hybrid: the lookup chain
    draft_s: float  # the mean drafter time the choice assumed
    decide_s: float  # time spent deciding
    rows: int | None = None  # the backbone block's positions (None: its trained block)


class AdaptiveDrafter:
    """Wraps a DFlash drafter; picks the chain depth (or, with tree=True, the DDTree budget) per round.
    With `lookup` (tree only), the prompt-lookup chain is merged in as in the hybrid drafter."""

    name = "adaptive"

    def __init__(
        self,
        dflash: DFlashDrafter,
        target: TargetModel | None,
        tree: bool = False,
        max_budget: int = 64,
        cost: CostModel | None = None,
        lookup: NgramDrafter | None = None,
    ) -> None:
        if lookup is not None and not tree:
            raise ValueError("an adaptive chain takes no lookup drafter (use tree=True)")
        self.dflash = dflash
        self.lookup = lookup
        # Acceptance statistics are host-side bookkeeping in Python floats (read and forgotten every round: as
        # tensors the forgetting alone was 8 ops, ~70 µs a request and round, dev/LOG.md session 40).
        self.look_accepted = [1.0] * dflash.block_size  # Beta(1,1) per lookup depth
        self.look_reached = [2.0] * dflash.block_size
        self._look_len = 0
        self.tree = tree
        self.max_budget = max_budget
        self.block_size = dflash.block_size
        self.hidden_layers = dflash.hidden_layers
        if cost is None:  # measured on the target when not handed one (forks share their parent's)
            if target is None:
                raise ValueError("an AdaptiveDrafter needs a target to measure its costs on, or a cost model")
            cost = CostModel(measure_verify_cost(target, [k for k in COST_SIZES if k <= max_budget + 1]))
        self.cost = cost
        self.accepted_at = [1.0] * self.block_size  # Beta(1,1) prior: 1 success ...
        self.reached = [2.0] * self.block_size  # ... out of 2 trials per depth
        self.draft_s = 0.0  # summed over the rounds that ran the drafter
        self.drafted = 0
        self.rounds = 0
        self.rho_num, self.rho_den = 1.0, 1.0  # tree calibration: accepted vs predicted
        self._params = SamplingParams()
        self.last_choice = 0
        self._predicted = 0.0
        self._depth = 0
        self._model_pays = True  # tree: the last drafted round's best tree beat a plain step
        # hybrid: arms[regime][drafted] (regime 0: the lookup proposed nothing, 1: it proposed a chain)
        self.arms = [[RoundRate(), RoundRate()], [RoundRate(), RoundRate()]]
        # Clocks that drain a GPU's queue before each reading (models/devices.py): `clock` times whole rounds for
        # the hybrid's rest rule (tests replace it with a fake one), `_timer` the drafter's own forwards.
        self.clock = device_clock(dflash.device)
        self._timer = device_clock(dflash.device)
        self._round: tuple[int, int, float] | None = None  # the open round: regime, drafted (0/1), start time
        self._round_tokens = 0
        self.rests = 0  # rounds that skipped the drafter
        self.probes = [ProbeSchedule(), ProbeSchedule()]  # per regime (chain and tree: only regime 0)
        self._decision: _Decision | None = None  # made by block_request, used by the next propose
        self._load: tuple[int, float, float] = (0, 0.0, 0.0)  # other requests' (rows, tokens, seconds)
        self._step_cost: StepCost | None = None  # batched: the engine's fitted prices of the next step
        self._model_paid = [True, True]  # hybrid, batched: per regime, whether the last drafted tree used the model
        # Batched: running mean seconds the engine spent finishing this request's rounds (verify, the LM head's
        # second pass, commit, observe), [rounds without the backbone, rounds with it] (observe_host)
        self._finish_s = [0.0, 0.0]
        self._backbone_ran = False  # the last built round ran the backbone

    def fork(self) -> AdaptiveDrafter:
        """The same backbone weights, cost model and clock, fresh acceptance statistics (Beta(1,1) priors)."""
        clone = AdaptiveDrafter(
            self.dflash.fork(), None, tree=self.tree, max_budget=self.max_budget, cost=self.cost, lookup=self.lookup
        )
        clone.clock = self.clock
        return clone

    def start(self, prompt_ids, target_hidden, params: SamplingParams, generator, adjust=None) -> None:
        """Reset per-request drafter state; acceptance statistics carry over (same model, same machine)."""
        self._params = params
        self._round = None  # the last round of the previous request ended with it, not at this propose
        self.dflash.start(prompt_ids, target_hidden, params, generator, adjust)

    def expected_chain(self) -> list[float]:
        """E(d) for d = 0..B: expected tokens emitted by a round with a depth-d chain."""
        return expected_tokens([a / r for a, r in zip(self.accepted_at, self.reached, strict=True)])

    def set_batch_load(self, rows: int, tokens: float, seconds: float, cost: StepCost | None = None) -> None:
        """The other requests of this request's next forward (the batched engine, from its last step): their rows,
        the tokens they emit and the seconds they add beyond their rows' cost (per-request attention, drafting).
        cost: the engine's fitted prices of that step (engine/step_costs.py; it then includes `seconds`), used
        instead of the probed cost(k) once the engine has one. Sizes are then chosen for the whole step's tokens
        per second (module doc)."""
        self._load = (rows, tokens, seconds)
        self._step_cost = cost

    def _rate(self, tokens: float, rows: int, draft_s: float) -> float:
        """Tokens per second of the step this round joins, if the round emits `tokens` from `rows` verify rows:
        (others' tokens + tokens) / (others' seconds + draft + cost(others' rows + rows)), or with the engine's
        fitted prices (others' tokens + tokens) / (step seconds without this round + draft + this round's rows
        and verifying); alone that is tokens / (draft + cost(rows))."""
        other_rows, other_tokens, other_s = self._load
        if self._step_cost is not None:
            return (other_tokens + tokens) / (draft_s + self._step_cost.seconds(rows))
        return (other_tokens + tokens) / (other_s + draft_s + self.cost(other_rows + rows))

    def observe_host(self, seconds: float) -> None:
        """The batched engine's seconds finishing this request's last round. A round that ran the backbone (a
        deeper draft: a longer walk, often the LM head's second pass, a tree commit) costs ~1 ms more at 4
        requests than a lookup-only one (dev/LOG.md, session 35): batched decisions charge that difference to
        the drafter with its own forward's time (`_decide`)."""
        i = int(self._backbone_ran)
        old = self._finish_s[i]
        self._finish_s[i] = seconds if old == 0.0 else HOST_FORGET * old + (1 - HOST_FORGET) * seconds

    def _extra_finish_s(self) -> float:
        """Seconds more a backbone round's finish costs than another round's, once both were measured."""
        without, with_backbone = self._finish_s
        return max(0.0, with_backbone - without) if without and with_backbone else 0.0

    def block_request(self, tokens: list[int], max_depth: int) -> tuple[DFlashDrafter, int, int | None] | None:
        """Decide this round now (the decision is kept for propose) and return the backbone forward it needs,
        or None when it rests (see DFlashDrafter.block_request)."""
        self._decision = self._decide(tokens, max_depth)
        return (self.dflash, self._decision.depth, self._decision.rows) if self._decision.depth else None

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """Draft the full block once, then keep the most profitable prefix (chain) or node count (tree)."""
        decision = self._decision
        self._decision = None
        if decision is None or decision.context != len(tokens):
            decision = self._decide(tokens, max_depth)
        return self._build(decision, tokens)

    def _decide(self, tokens: list[int], max_depth: int) -> _Decision:
        """Rest or draft, and how deep (every side effect of deciding happens here, once per round)."""
        t0 = self._timer()
        depth = min(self.block_size, max_depth)
        draft_s = self.draft_s / self.drafted if self.drafted else 0.0
        if self._load[0] > 0 and self._step_cost is None:
            # batched on probed costs: the engine's extra work finishing a backbone round is the drafter's too
            # (the engine's fitted prices hold it in per_verify)
            draft_s += self._extra_finish_s()
        n = len(tokens)
        if self._step_cost is not None and not self._step_cost.drafts:  # the engine's gate: a plain step for all
            self.last_choice = self._depth = self._look_len = 0
            self._predicted, self._round = 0.0, None
            return _Decision(n, 0, None, draft_s, self._timer() - t0)
        # Batched, the backbone drafts a short block (BATCHED_ROWS): its cost is per block row, and a batch's
        # drafts stay shallow (a verify row is not free there). The lookup chain keeps the full depth.
        rows = BATCHED_ROWS if self._load[0] > 0 and self.dflash.block > BATCHED_ROWS else None
        deep = min(depth, rows - 1) if rows else depth
        if not self.tree:
            d_best, pays = self._best_depth(deep, draft_s)
            if self._rests_now(pays):
                self.last_choice = self._depth = 0  # one plain step; the backbone's context keeps queueing
                return _Decision(n, 0, None, draft_s, self._timer() - t0)
            explore = pays and self.rounds % EXPLORE_EVERY == 0
            return _Decision(n, deep if explore else d_best, None, draft_s, self._timer() - t0, rows)
        if self.lookup is None:
            if self._rests_now(self._model_pays):
                self._predicted, self.last_choice = 0.0, 0  # one plain step
                return _Decision(n, 0, None, draft_s, self._timer() - t0)
            return _Decision(n, deep, None, draft_s, self._timer() - t0, rows)
        now = self.clock()
        if self._round is not None:  # the previous round ends where this one starts
            self._close_round(now)
        look = self.lookup.propose(tokens, depth)
        regime = int(look.num_nodes > 0)
        rests = self._rests_now(self.hybrid_model_pays(regime), regime)
        self._round = (regime, int(not rests), now)
        return _Decision(n, 0 if rests else deep, look, draft_s, self._timer() - t0, rows)

    def _build(self, decision: _Decision, tokens: list[int]) -> Draft:
        """The draft a decision asks for (the backbone forward may have run already, batched: draft_blocks)."""
        self._backbone_ran = bool(decision.depth)
        if not decision.depth:
            return self._rest_hybrid(decision.look) if decision.look is not None else Draft.empty()
        t0 = self._timer()
        depth, draft_s = decision.depth, decision.draft_s
        logits = self.dflash.draft_logits(tokens[-1], len(tokens) - 1, depth, rows=decision.rows)  # [D, Vd]
        if not self.tree:
            draft = self._chain(logits, depth)
        elif decision.look is None:
            draft = self._tree(logits, draft_s)
        else:
            draft = self._hybrid(decision.look, logits, draft_s)
        self.draft_s += decision.decide_s + self._timer() - t0 + self.dflash.take_borrowed_s()
        self.drafted += 1
        self.rounds += 1
        return draft

    def _rests_now(self, pays: bool, regime: int = 0) -> bool:
        """Whether this round skips the drafter (counted as a round and a rest); see ProbeSchedule."""
        rests = self.probes[regime].rests_now(pays)
        self.rests += int(rests)
        self.rounds += int(rests)
        return rests

    def _close_round(self, now: float) -> None:
        """Add the open round to its arm. A probe that alone beat the resting arm brings the next probe forward
        (one probe moves the drafting arm by only 1 − ARM_FORGET)."""
        assert self._round is not None
        regime, drafted, start = self._round
        arm = self.arms[regime][drafted]
        seconds = now - start
        arm.add(self._round_tokens, seconds)
        rested = self.arms[regime][0]
        if drafted and rested.weight >= ARM_EVIDENCE and self._round_tokens >= rested.rate() * seconds:
            self.probes[regime].bring_forward()

    def hybrid_model_pays(self, regime: int) -> bool:
        """Hybrid: whether drafting rounds have emitted more tokens per second than resting ones (module doc);
        regime 0: the lookup proposed nothing (resting is a plain step), 1: it proposed a chain."""
        if self._load[0] > 0:  # batched: a round's wall time is the whole batch's; decide by the batch-aware rate
            return self._model_paid[regime]
        rested, drafted = self.arms[regime]
        if drafted.weight < ARM_EVIDENCE:
            return True  # measure drafting first: it is the default
        if rested.weight < ARM_EVIDENCE:
            return False  # then resting
        return drafted.rate() >= rested.rate()

    def _lookup_expected(self, length: int) -> list[float]:
        """E(l) = 1 + Σ_{j ≤ l} Π_{i ≤ j} β_i for the lookup chain cut to l = 0..length nodes, in host floats
        (once per request and round: tensor ops cost more)."""
        seen = zip(self.look_accepted[:length], self.look_reached[:length], strict=True)
        return expected_tokens([a / r for a, r in seen])

    def _lookup_rates(self, length: int) -> list[float]:
        """The forward's tokens per second with the lookup chain cut to l = 0..length nodes and no drafter."""
        return [self._rate(e, n + 1, 0.0) for n, e in enumerate(self._lookup_expected(length))]

    def _rest_hybrid(self, look: Draft) -> Draft:
        """A round without the drafter: the lookup chain alone, cut to its most profitable length."""
        rate = self._lookup_rates(look.num_nodes)
        keep = max(range(len(rate)), key=rate.__getitem__)
        self._predicted = 0.0
        self._look_len = self.last_choice = keep
        return Draft.chain(look.tokens[:keep])

    def _best_depth(self, depth: int, draft_s: float) -> tuple[int, bool]:
        """The chain depth d ≥ 1 with the highest expected tokens per second, and whether it beats a plain step."""
        e = self.expected_chain()
        rate = {d: self._rate(e[d], d + 1, draft_s) for d in range(1, depth + 1)}
        d_best = max(rate, key=rate.__getitem__, default=0)
        return d_best, d_best > 0 and rate[d_best] >= self._rate(1.0, 1, 0.0)

    def _chain(self, logits: torch.Tensor, depth: int) -> Draft:
        """The first `depth` tokens of the drafted block as a chain."""
        self.last_choice, self._depth = depth, depth
        return self.dflash.chain_from_logits(logits[:depth])

    def _tree(self, logits: torch.Tensor, draft_s: float) -> Draft:
        # Trees are built on the host: one copy of the block's log-probs per round.
        logp = tree_logp(self.dflash.marginals(logits), self._params).cpu()
        ids, parents = build_tree(logp, self.max_budget)
        path_p, _ = self._path_probs(logp, ids, parents)  # [N] in pop order
        rho = self.rho_num / self.rho_den
        rate, predicted = [], 0.0  # E(N) = 1 + ρ Σ_{first N} Π p̂ for N = 1..max
        for p in path_p:
            predicted += p
            rate.append(self._rate(1 + rho * predicted, len(rate) + 2, draft_s))
        n_best = 1 + max(range(len(rate)), key=rate.__getitem__) if rate else 0
        self._model_pays = bool(rate) and rate[n_best - 1] >= self._rate(1.0, 1, 0.0)
        self.last_choice = n_best
        self._predicted = sum(path_p[:n_best])
        return Draft.tree(self.dflash.ids_to_target(ids[:n_best]), parents[:n_best])

    def _hybrid(self, look: Draft, logits: torch.Tensor, draft_s: float) -> Draft:
        """Lookup chain (always; in a batch cut to its profitable length, as a verify row is not free there)
        + the profitable number of DDTree nodes, merged as a trie. The rule runs in host floats: per candidate
        size a handful of tensor ops had cost ~0.4 ms per request and round (dev/LOG.md, session 35)."""
        regime = int(look.num_nodes > 0)
        if self._load[0] > 0:
            look = self._rest_hybrid(look)
        # Trees are built on the host: one copy of the block's log-probs per round.
        logp = tree_logp(self.dflash.marginals(logits), self._params).cpu()
        ids, parents = build_tree(logp, self.max_budget)
        path_p, depth = self._path_probs(logp, ids, parents)  # [N], depths
        toks = self.dflash.ids_to_target(ids)
        look_toks = look.tokens.tolist()
        length = len(look_toks)
        look_gain = self._lookup_expected(length)[-1] - 1  # Σ_{j ≤ L} Π_{i ≤ j} β_i
        rho = self.rho_num / self.rho_den
        # Candidate n: the first n model nodes merged onto the chain. A node on the lookup path (its parent on it
        # too, its token the chain's at its depth) costs no row and adds no predicted gain of its own.
        on_look: list[bool] = []
        gains, sizes = [0.0], [length]
        for tok, par, d, p in zip(toks, parents, depth, path_p, strict=True):
            on = (par < 0 or on_look[par]) and d < length and tok == look_toks[d]
            on_look.append(on)
            gains.append(gains[-1] + (0.0 if on else p))
            sizes.append(sizes[-1] + (not on))
        rate = [self._rate(1 + look_gain + rho * g, n + 1, draft_s) for g, n in zip(gains, sizes, strict=True)]
        n_best = max(range(len(rate)), key=rate.__getitem__)
        # Batched rest rule: whether running the drafter pays at all. `rate` charges draft_s to every option (it
        # is spent by now), so compare with the lookup chain alone at its best length without it.
        self._model_paid[regime] = n_best > 0 and rate[n_best] >= max(self._lookup_rates(length))
        self.last_choice = sizes[n_best]
        self._predicted = gains[n_best]
        self._look_len = length
        model = Draft.tree(toks[:n_best], parents[:n_best])
        return merge_trees(look, model, budget=length + n_best)

    def _forget(self) -> None:
        """Shrink every count towards its prior (Beta(1,1) per depth; ρ = 1/1) by FORGET."""
        self.accepted_at, self.look_accepted = _toward(self.accepted_at, 1.0), _toward(self.look_accepted, 1.0)
        self.reached, self.look_reached = _toward(self.reached, 2.0), _toward(self.look_reached, 2.0)
        self.rho_num = 1 + FORGET * (self.rho_num - 1)
        self.rho_den = 1 + FORGET * (self.rho_den - 1)

    @staticmethod
    def _path_probs(logp: torch.Tensor, ids: list[int], parents: list[int]) -> tuple[list[float], list[int]]:
        """Π p̂ along each node's path [N], and each node's depth (0 = a child of the root)."""
        depth: list[int] = []
        for par in parents:
            depth.append(0 if par < 0 else depth[par] + 1)
        if not ids:
            return [], depth
        own = logp[depth, ids].tolist()  # one gather: each node's own log p̂
        score: list[float] = []
        for par, lp in zip(parents, own, strict=True):
            score.append((0.0 if par < 0 else score[par]) + lp)
        return torch.tensor(score, device="cpu").exp().tolist(), depth

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Update acceptance statistics, then the backbone's context."""
        a = verdict.num_accepted
        self._forget()
        if self.tree:
            a_look = 0  # the merged lookup chain occupies nodes 0..L-1, node j at depth j+1
            while a_look < min(a, self._look_len) and verdict.path[a_look] == a_look:
                a_look += 1
            if self._look_len:
                for j in range(min(a_look + 1, self._look_len)):
                    self.look_reached[j] += 1
                for j in range(a_look):
                    self.look_accepted[j] += 1
            self.rho_num += a - a_look
            self.rho_den += self._predicted
            self._round_tokens = a + 1
        else:
            reached = min(a + 1, self._depth)  # depths 1..a accepted; depth a+1 tried and rejected (if drafted)
            for j in range(reached):
                self.reached[j] += 1
            for j in range(a):
                self.accepted_at[j] += 1
        self.dflash.observe(verdict, target_hidden)
