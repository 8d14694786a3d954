"""Adaptive block budget: each round, draft the size that maximises expected tokens per second.

The rule (measured costs, running acceptance):

    cost(k)   = seconds of one target forward over k new tokens, measured once at start-up on this machine
                (median of a few runs after a 128-token context), linearly interpolated between sizes
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
              (hybrid) when the model part's realised marginal rate is below what the round gives without it,
                  Σ (a − a_look) / Σ (draft + cost(size+1) − cost(L+1))  <  Σ (1 + a_look) / Σ cost(L+1),
              the round skips the drafter and verifies the lookup chain alone, cut to its best length by the
              chain rule on β (possibly 0: a plain step). Rounds where the lookup proposes nothing and rounds
              where it proposes a chain keep separate sums and probe schedules: without a chain the model
              competes with a plain step (right side 1 / cost(1)), which it beats far more often than it beats
              a matched lookup chain; pooled, HumanEval's long lookup matches rested the model in the rounds
              where it was the only drafter (session 17). The sums are realised, not predicted, and forget
              at MODEL_FORGET per drafted round: resting after one unprofitable round, as a first version
              did, parked the model right before the rounds where it paid and lost on HumanEval
              (dev/LOG.md, session 11); at temperature 1 the never-resting hybrid ran at 0.7x of plain
              sampling (session 16).
    probe     a resting drafter drafts (probes) after 7 resting rounds, then after twice as many each time
              it is still unprofitable, up to MAX_PROBE_GAP: a probe costs a drafter forward and a verify, and
              with one every 8th round the resting hybrid's round cost at temperature 1 was 1.32 plain steps
              against lookup's 1.17 at the same τ (session 17). A chain's probe drafts only its best depth
              (on a CPU where a deep verify costs three plain steps, a whole-block probe would cost more than
              resting saves); a tree's re-decides whether its trees pay.

Every 8th round of a chain that pays verifies the whole block, so acceptance at depths the rule stopped using
stays measured.
The counts behind α, β and ρ forget (weight FORGET per round, towards their prior): acceptance swings between
turns (a repetitive answer accepts whole blocks, the next one does not), and a rule that pooled all history
kept drafting deep after such a turn (dev/LOG.md, session 9).

A best-first tree's first N nodes are themselves a valid tree (parents are popped before children), so one
DDTree build serves every candidate N. The choice never affects correctness: verification is unchanged.
"""

from __future__ import annotations

import statistics
import time

import torch

from byblock.drafters.ddtree import build_tree, tree_logp
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.hybrid import merge_trees
from byblock.drafters.ngram import NgramDrafter
from byblock.models.adapter import TargetModel
from byblock.models.kv_cache import KVCache
from byblock.sampling.params import SamplingParams
from byblock.verify.types import Draft, Verdict

# both sides of each ROW_CHUNK boundary (models/invariant.py): 33 rows cost a second linear pass, a step that
# interpolating between 32 and 48 would smear out
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64, 65)
EXPLORE_EVERY = 8
FORGET = 0.95  # per round, the weight of older acceptance evidence (memory ~20 rounds: a turn is 50-100)
# hybrid: per drafted round, the weight of older evidence on what the model part realised. Faster than FORGET
# because while resting only probes are drafted: one or two good probes end a rest.
MODEL_FORGET = 0.7
MODEL_EVIDENCE = 2.0  # hybrid: rest only after this much (forgetting-weighted) drafted-round evidence
MAX_PROBE_GAP = 63  # hybrid: at most this many resting rounds between two probes


def measure_verify_cost(target: TargetModel, sizes=COST_SIZES, context: int = 128, repeats: int = 3) -> dict:
    """Median seconds of one target forward over k new tokens after `context` cached ones, per k."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, max(11, target.vocab_size - 1), (1, context + max(sizes)), generator=g)
    cache = KVCache()  # a plain cache: compressed ones (H2O, windows) are committed, not cropped
    target.forward(ids[:, :context], cache, logits_to_keep=1)
    out = {}
    for k in sizes:
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            target.forward(ids[:, context : context + k], cache)
            times.append(time.perf_counter() - t)
            cache.crop(context)
        out[k] = statistics.median(times[1:])  # the first run warms the kernels for this shape
    return out


class CostModel:
    """Piecewise-linear cost(k) from measured points."""

    def __init__(self, points: dict[int, float]) -> None:
        self.ks = sorted(points)
        self.ts = [points[k] for k in self.ks]

    def __call__(self, k: int) -> float:
        ks, ts = self.ks, self.ts
        if k <= ks[0]:
            return ts[0]
        for (k0, t0), (k1, t1) in zip(zip(ks, ts, strict=True), zip(ks[1:], ts[1:], strict=True), strict=False):
            if k <= k1:
                return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return ts[-1] * k / ks[-1]  # past the last point: proportional


class AdaptiveDrafter:
    """Wraps a DFlash drafter; picks the chain depth (or, with tree=True, the DDTree budget) per round.
    With `lookup` (tree only), the prompt-lookup chain is merged in as in the hybrid drafter."""

    name = "adaptive"

    def __init__(
        self,
        dflash: DFlashDrafter,
        target: TargetModel,
        tree: bool = False,
        max_budget: int = 64,
        cost: CostModel | None = None,
        lookup: NgramDrafter | None = None,
    ) -> None:
        if lookup is not None and not tree:
            raise ValueError("an adaptive chain takes no lookup drafter (use tree=True)")
        self.dflash = dflash
        self.lookup = lookup
        self.look_accepted = torch.ones(dflash.block_size)  # Beta(1,1) per lookup depth, as for the chain
        self.look_reached = 2 * torch.ones(dflash.block_size)
        self._look_len = 0
        self.tree = tree
        self.max_budget = max_budget
        self.block_size = dflash.block_size
        self.hidden_layers = dflash.hidden_layers
        self.cost = cost or CostModel(measure_verify_cost(target, [k for k in COST_SIZES if k <= max_budget + 1]))
        self.accepted_at = torch.ones(self.block_size)  # Beta(1,1) prior: 1 success ...
        self.reached = 2 * torch.ones(self.block_size)  # ... out of 2 trials per depth
        self.draft_s = 0.0  # summed over the rounds that ran the drafter
        self.drafted = 0
        self.rounds = 0
        self.rho_num, self.rho_den = 1.0, 1.0  # tree calibration: accepted vs predicted
        self._params = SamplingParams()
        self.last_choice = 0
        self._predicted = 0.0
        self._depth = 0
        self._model_pays = True  # tree: the last drafted round's best tree beat a plain step
        # hybrid, realised forgetting sums: tokens and seconds the model part added, per regime (index 0: the
        # lookup proposed nothing, 1: it proposed a chain), and what the lookup part gave in regime 1
        self.model_tok, self.model_s, self.model_w = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
        self.look_tok, self.look_s = 0.0, 0.0
        self._regime = 0
        self._round_draft_s = 0.0  # this round's drafter seconds (0 when it rested)
        self._size = 0  # hybrid: nodes in this round's merged tree
        self.rests = 0  # rounds that skipped the drafter
        # per regime (chain and tree: only regime 0): resting rounds before the next probe, and since the last
        # drafted round (starting at the gap: the first unprofitable round probes)
        self._probe_gap = [EXPLORE_EVERY - 1, EXPLORE_EVERY - 1]
        self._resting_for = [EXPLORE_EVERY - 1, EXPLORE_EVERY - 1]

    def start(self, prompt_ids, target_hidden, params: SamplingParams, generator) -> None:
        """Reset per-request drafter state; acceptance statistics carry over (same model, same machine)."""
        self._params = params
        self.dflash.start(prompt_ids, target_hidden, params, generator)

    def expected_chain(self) -> torch.Tensor:
        """E(d) for d = 0..B−1: expected tokens emitted by a round with a depth-d chain."""
        alpha = self.accepted_at / self.reached  # [B−1]
        return torch.cat([torch.ones(1), 1 + alpha.cumprod(0).cumsum(0)])

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """Draft the full block once, then keep the most profitable prefix (chain) or node count (tree)."""
        t0 = time.perf_counter()
        depth = min(self.block_size, max_depth)
        draft_s = self.draft_s / self.drafted if self.drafted else 0.0
        if not self.tree:
            d_best, pays = self._best_depth(depth, draft_s)
            if self._rests_now(pays):
                self.last_choice = self._depth = 0  # one plain step; the backbone's context keeps queueing
                return Draft.empty()
            explore = pays and self.rounds % EXPLORE_EVERY == 0
            chain_depth = depth if explore else d_best
            draft = self._chain(self.dflash.draft_logits(tokens[-1], len(tokens) - 1, chain_depth), chain_depth)
        elif self.lookup is None:
            if self._rests_now(self._model_pays):
                self._predicted, self.last_choice = 0.0, 0  # one plain step
                return Draft.empty()
            draft = self._tree(self.dflash.draft_logits(tokens[-1], len(tokens) - 1, depth), draft_s)
        else:
            look = self.lookup.propose(tokens, depth)
            self._regime = int(look.num_nodes > 0)
            if self._rests_now(self.hybrid_model_pays(self._regime), self._regime):
                return self._rest_hybrid(look)
            logits = self.dflash.draft_logits(tokens[-1], len(tokens) - 1, depth)  # [D, Vd]
            draft = self._hybrid(look, logits, draft_s)
        self._round_draft_s = time.perf_counter() - t0
        self.draft_s += self._round_draft_s
        self.drafted += 1
        self.rounds += 1
        return draft

    def _rests_now(self, pays: bool, regime: int = 0) -> bool:
        """Whether this round skips the drafter: not while drafting pays, and not on a probe (see the module doc)."""
        if pays:
            self._probe_gap[regime], self._resting_for[regime] = EXPLORE_EVERY - 1, 0
            return False
        if self._resting_for[regime] < self._probe_gap[regime]:
            self._resting_for[regime] += 1
            self.rests += 1
            self.rounds += 1
            return True
        self._probe_gap[regime] = min(2 * self._probe_gap[regime] + 1, MAX_PROBE_GAP)  # if this probe fails too
        self._resting_for[regime] = 0
        return False

    def hybrid_model_pays(self, regime: int) -> bool:
        """Hybrid: whether the model part's realised tokens per second beat the round without it (module doc);
        regime 0: the lookup proposed nothing (the alternative is a plain step), 1: it proposed a chain."""
        if self.model_w[regime] < MODEL_EVIDENCE:
            return True  # too little evidence: keep drafting
        base_tok, base_s = (1.0, self.cost(1)) if regime == 0 else (self.look_tok, self.look_s)
        return self.model_tok[regime] * base_s >= base_tok * max(self.model_s[regime], 1e-9)

    def _rest_hybrid(self, look: Draft) -> Draft:
        """A round without the drafter: the lookup chain alone, cut to its most profitable length."""
        beta = (self.look_accepted / self.look_reached)[: look.num_nodes].cumprod(0)  # [L]
        expected = torch.cat([torch.ones(1), 1 + beta.cumsum(0)])  # E(l) for l = 0..L
        rate = [float(expected[n]) / self.cost(n + 1) for n in range(look.num_nodes + 1)]
        keep = max(range(len(rate)), key=rate.__getitem__)
        self._round_draft_s, self._predicted = 0.0, 0.0
        self._look_len = self.last_choice = keep
        return Draft.chain(look.tokens[:keep])

    def _best_depth(self, depth: int, draft_s: float) -> tuple[int, bool]:
        """The chain depth d ≥ 1 with the highest expected tokens per second, and whether it beats a plain step."""
        e = self.expected_chain()
        rate = {d: float(e[d]) / (draft_s + self.cost(d + 1)) for d in range(1, depth + 1)}
        d_best = max(rate, key=rate.__getitem__, default=0)
        return d_best, d_best > 0 and rate[d_best] >= 1.0 / self.cost(1)

    def _chain(self, logits: torch.Tensor, depth: int) -> Draft:
        """The first `depth` tokens of the drafted block as a chain."""
        self.last_choice, self._depth = depth, depth
        return self.dflash.chain_from_logits(logits[:depth])

    def _tree(self, logits: torch.Tensor, draft_s: float) -> Draft:
        logp = tree_logp(logits, self._params)
        ids, parents = build_tree(logp, self.max_budget)
        path_p, _ = self._path_probs(logp, ids, parents)  # [N] in pop order
        expected = 1 + (self.rho_num / self.rho_den) * path_p.cumsum(0)  # E(N) for N = 1..max
        rate = [float(expected[n - 1]) / (draft_s + self.cost(n + 1)) for n in range(1, len(ids) + 1)]
        n_best = 1 + max(range(len(rate)), key=rate.__getitem__) if rate else 0
        self._model_pays = bool(rate) and rate[n_best - 1] >= 1.0 / self.cost(1)
        self.last_choice = n_best
        self._predicted = float(path_p[:n_best].sum())
        toks = self.dflash.to_target(torch.tensor(ids[:n_best], dtype=torch.long))[0]
        return Draft(tokens=toks, parents=torch.tensor(parents[:n_best], dtype=torch.long))

    def _hybrid(self, look: Draft, logits: torch.Tensor, draft_s: float) -> Draft:
        """Lookup chain (always) + the profitable number of DDTree nodes, merged as a trie."""
        logp = tree_logp(logits, self._params)
        ids, parents = build_tree(logp, self.max_budget)
        path_p, depth = self._path_probs(logp, ids, parents)  # [N], depths
        toks = torch.empty(0, dtype=torch.long)
        if ids:
            toks = self.dflash.to_target(torch.tensor(ids, dtype=torch.long))[0]
        look_toks = look.tokens.tolist()
        length = len(look_toks)
        on_look: list[bool] = []  # model node i lies on the lookup path (merging it costs no node)
        for tok, par, d in zip(toks.tolist(), parents, depth, strict=True):
            on_look.append((par < 0 or on_look[par]) and d < length and tok == look_toks[d])
        new = ~torch.tensor(on_look, dtype=torch.bool)
        beta = (self.look_accepted / self.look_reached)[:length].cumprod(0)
        rho = self.rho_num / self.rho_den
        gain = float(beta.sum()) + rho * torch.cat([torch.zeros(1), (path_p * new).cumsum(0)])  # [N+1]
        size = length + torch.cat([torch.zeros(1, dtype=torch.long), new.long().cumsum(0)])  # [N+1]
        rate = [float(1 + gain[n]) / (draft_s + self.cost(int(size[n]) + 1)) for n in range(len(ids) + 1)]
        n_best = max(range(len(rate)), key=rate.__getitem__)
        self.last_choice = int(size[n_best])
        self._predicted = float((path_p * new)[:n_best].sum())
        self._look_len = length
        self._size = int(size[n_best])
        model = Draft(tokens=toks[:n_best], parents=torch.tensor(parents[:n_best], dtype=torch.long))
        return merge_trees(look, model, budget=length + n_best)

    def _forget(self) -> None:
        """Shrink every count towards its prior (Beta(1,1) per depth; ρ = 1/1) by FORGET."""
        for acc, seen in ((self.accepted_at, self.reached), (self.look_accepted, self.look_reached)):
            acc.sub_(1).mul_(FORGET).add_(1)
            seen.sub_(2).mul_(FORGET).add_(2)
        self.rho_num = 1 + FORGET * (self.rho_num - 1)
        self.rho_den = 1 + FORGET * (self.rho_den - 1)

    def _observe_hybrid_rates(self, accepted: int, a_look: int) -> None:
        """Add this round's realised tokens and seconds to the lookup part's and (if drafted) the model part's sums."""
        r = self._regime
        look_cost = self.cost(self._look_len + 1)
        if r == 1:
            self.look_tok = FORGET * self.look_tok + 1 + a_look
            self.look_s = FORGET * self.look_s + look_cost
        if self._round_draft_s > 0.0:  # the drafter ran: the nodes past the lookup path are the model's
            extra_s = self._round_draft_s + max(0.0, self.cost(self._size + 1) - look_cost)
            self.model_tok[r] = MODEL_FORGET * self.model_tok[r] + (accepted - a_look)
            self.model_s[r] = MODEL_FORGET * self.model_s[r] + extra_s
            self.model_w[r] = MODEL_FORGET * self.model_w[r] + 1

    @staticmethod
    def _path_probs(logp: torch.Tensor, ids: list[int], parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Π p̂ along each node's path [N], and each node's depth (0 = a child of the root)."""
        depth: list[int] = []
        score: list[float] = []
        for tok, par in zip(ids, parents, strict=True):
            d = 0 if par < 0 else depth[par] + 1
            depth.append(d)
            score.append((0.0 if par < 0 else score[par]) + float(logp[d, tok]))
        return torch.tensor(score).exp(), depth

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Update acceptance statistics, then the backbone's context."""
        a = verdict.num_accepted
        self._forget()
        if self.tree:
            a_look = 0  # the merged lookup chain occupies nodes 0..L-1, node j at depth j+1
            while a_look < min(a, self._look_len) and verdict.path[a_look] == a_look:
                a_look += 1
            if self._look_len:
                self.look_reached[: min(a_look + 1, self._look_len)] += 1
                self.look_accepted[:a_look] += 1
            self.rho_num += a - a_look
            self.rho_den += self._predicted
            if self.lookup is not None:
                self._observe_hybrid_rates(a, a_look)
        else:
            reached = min(a + 1, self._depth)  # depths 1..a accepted; depth a+1 tried and rejected (if drafted)
            self.reached[:reached] += 1
            self.accepted_at[:a] += 1
        self.dflash.observe(verdict, target_hidden)
