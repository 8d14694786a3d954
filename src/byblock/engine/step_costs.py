"""What a batched step costs, fitted from the engine's own steps: the prices adaptive drafters size drafts by.

A verify row is not free in a batch, and what it costs there is not what it cost in the one-request probe
(drafters/costs.py): at 4 requests on a 2-core CPU the int8 GEMMs are compute-bound, each row ~0.7 ms, and a
round that verifies a draft adds host work of its own (the verify walk, the LM head's second pass, the commit,
the drafter's observe) that no forward probe sees. The probe's curve is also noisy where it matters (16 and 24
rows measured within 2 % of each other on the EPYC of session 40: rows there looked free). So the engine fits,
from every step it runs,

    step seconds − the rounds' own drafting seconds  ≈  fixed + per_seq · requests + per_row · decode rows
                                                          + per_prefill · prefill rows + per_verify · verifying

by least squares with forgetting (FORGET per step), ridge-pulled towards a prior from the probe (PRIOR_STEPS
steps' worth of evidence), so a coefficient the recent steps cannot separate (every request resting: decode
rows = requests) stays at its prior instead of wandering. Each request then gets a `StepCost`: the seconds of
the step that do not depend on its own round, and the prices of its rows and of verifying at all.

Per-request choices on those prices are each right on their own and can still lose together (16 requests:
0.85x a plain batch with calibrated predictions), so `DraftGate` decides by the clock whether the batch's
drafters may draft at all.
"""

from __future__ import annotations

from byblock.drafters.costs import StepCost

FORGET = 0.98  # per step: the fit's memory is ~50 steps (a few requests' lifetimes at 4 in flight)
PRIOR_STEPS = 0.25  # the prior weighs as much as this many steps at typical feature values (it only has to hold
# what the steps cannot separate; at 2, a wrong prior biased the fixed cost by ~10 % at 50 steps of memory)
READY_STEPS = 16.0  # forgetting-weighted steps before the fit is handed to drafters
SOLVE_EVERY = 4  # steps between solves (the rates change slowly; a 5x5 solve is cheap but not free)
TYPICAL = (1.0, 4.0, 8.0, 8.0, 2.0)  # feature scales the prior's strength is set at
__all__ = ["DraftGate", "StepCost", "StepCostFit"]

GATE_BLOCK = 8  # steps per measured block of one gate mode
GATE_PROBE_EVERY = 6  # blocks of the faster mode between two blocks of the other
GATE_FORGET = 0.7  # per block of a mode, the weight of its older blocks

FEATURES = ("fixed", "per_seq", "per_row", "per_prefill", "per_verify")


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (host floats); None if singular."""
    n = len(b)
    m = [[*row, v] for row, v in zip(a, b, strict=True)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-18:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / m[c][c]
    return x


class StepCostFit:
    """Forgetting ridge least squares of a step's seconds on its shape (see the module docstring)."""

    def __init__(self, prior: tuple[float, float, float, float, float]) -> None:
        """prior: (fixed, per_seq, per_row, per_prefill, per_verify) seconds, e.g. from the probe's curve."""
        if len(prior) != len(FEATURES) or min(prior) < 0:
            raise ValueError(f"a step-cost prior is {len(FEATURES)} non-negative seconds: {prior}")
        self.prior = tuple(float(p) for p in prior)
        n = len(FEATURES)
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self.weight = 0.0  # forgetting-weighted steps seen
        self._steps = 0
        self.coef = self.prior
        self.prefill_rows = 0.0  # forgetting mean of prefill rows a step (they join after drafts are sized)

    @property
    def ready(self) -> bool:
        """Whether enough steps were seen for drafters to use the fit."""
        return self.weight >= READY_STEPS

    def add(self, seconds: float, seqs: int, decode_rows: int, prefill_rows: int, verifying: int) -> None:
        """One step: its seconds (without the rounds' own drafting) and its shape."""
        x = (1.0, float(seqs), float(decode_rows), float(prefill_rows), float(verifying))
        for i, xi in enumerate(x):
            row = self._xx[i]
            for j, xj in enumerate(x):
                row[j] = FORGET * row[j] + xi * xj
            self._xy[i] = FORGET * self._xy[i] + xi * seconds
        self.weight = FORGET * self.weight + 1.0
        self.prefill_rows = FORGET * self.prefill_rows + (1 - FORGET) * prefill_rows
        self._steps += 1
        if self._steps % SOLVE_EVERY == 0:
            self._refit()

    def _refit(self) -> None:
        lam = [PRIOR_STEPS * t * t for t in TYPICAL]
        a = [[v + (lam[i] if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xx)]
        b = [v + lam[i] * p for i, (v, p) in enumerate(zip(self._xy, self.prior, strict=True))]
        x = _solve(a, b)
        if x is not None:
            self.coef = tuple(max(0.0, v) for v in x)  # a negative price is noise: never a reason to draft more

    def for_request(
        self, seqs: int, other_rows: int, other_verifying: int, other_draft_s: float, drafts: bool = True
    ) -> StepCost:
        """A request's StepCost in a step of `seqs` requests whose others put `other_rows` decode rows in it,
        `other_verifying` of them verifying a draft, and spend `other_draft_s` drafting (drafts: DraftGate's)."""
        fixed, per_seq, per_row, per_prefill, per_verify = self.coef
        base = fixed + per_seq * seqs + per_prefill * self.prefill_rows + per_verify * other_verifying
        base += per_row * other_rows + other_draft_s
        return StepCost(base, per_row, per_verify, drafts)

    def prefill_s(self, rows: int) -> float:
        """The fitted seconds of `rows` prefill rows."""
        return self.coef[3] * rows


class DraftGate:
    """Whether a batch's adaptive drafters may draft at all, by the clock: blocks of GATE_BLOCK steps in one mode
    (drafting allowed, or every request a plain step), each mode's tokens per second (prefill's fitted seconds
    taken out) a forgetting sum over its blocks (GATE_FORGET per block); run the faster mode, and one block of
    the other every GATE_PROBE_EVERY blocks.

    Why: each request drafts when its own extra tokens per extra second beat the step's rate, and that rate is
    the one the drafting requests lowered. At 16 requests on the EPYC the requests' predictions were calibrated
    (2.37 tokens predicted a drafted round, 2.41 realized) and the prices added up, yet the batch ran 0.85x a
    plain batch: each best response held, the sum of them did not (dev/LOG.md, session 40). The clock measures
    the sum."""

    def __init__(self) -> None:
        self.tokens = {True: 0.0, False: 0.0}
        self.seconds = {True: 0.0, False: 0.0}
        self.blocks = {True: 0, False: 0}
        self.drafts = True  # measure drafting first: it is the default
        self._left = GATE_BLOCK
        self._block = [0.0, 0.0]  # tokens, seconds of the open block
        self._since_other = 0  # blocks of the better mode since the other was measured

    def rate(self, drafts: bool) -> float:
        """Tokens per second of the steps run in that mode (0 before any)."""
        return self.tokens[drafts] / self.seconds[drafts] if self.seconds[drafts] > 0 else 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """One gated step: the tokens it emitted and its seconds without prefill."""
        self._block[0] += tokens
        self._block[1] += max(seconds, 0.0)
        self._left -= 1
        if self._left == 0:
            self._close_block()

    def _close_block(self) -> None:
        mode = self.drafts
        self.tokens[mode] = GATE_FORGET * self.tokens[mode] + self._block[0]
        self.seconds[mode] = GATE_FORGET * self.seconds[mode] + self._block[1]
        self.blocks[mode] += 1
        self._block, self._left = [0.0, 0.0], GATE_BLOCK
        if not self.blocks[not mode]:  # the other mode was never measured
            self.drafts = not mode
            return
        best = self.rate(True) >= self.rate(False)
        if mode != best:  # a probe that lost, or the measured mode fell behind
            self.drafts, self._since_other = best, 0
            return
        self._since_other += 1
        if self._since_other >= GATE_PROBE_EVERY:
            self.drafts, self._since_other = not best, 0
