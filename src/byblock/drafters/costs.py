"""What verification costs on this machine, measured once: the cost model adaptive drafters size drafts with.

cost(k)    seconds of one target forward over k new tokens after a 128-token context (median of a few runs,
           the LM head over the rows a verification reads first), linearly interpolated between sizes
segment    seconds one more request adds to a packed forward beyond its rows (its own attention, appends):
           what makes a verify row not free in a batch (engine/batched.py)
StepCost   one request's prices in a batched step, from the engine's own fit of its steps (engine/step_costs.py)
"""

from __future__ import annotations

import statistics
import weakref
from dataclasses import dataclass

import torch

from byblock.kv.kv_cache import KVCache
from byblock.models.adapter import TargetModel
from byblock.models.devices import device_clock
from byblock.models.host_memory import release_freed_memory
from byblock.verify.rows import FIRST_ROWS

# both sides of each ROW_CHUNK boundary (kernels/invariant.py): 33 rows cost a second linear pass, a step that
# interpolating between 32 and 48 would smear out
COST_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 33, 48, 64, 65)


PROBE_ROWS = 512  # distinct embedding rows the timing forwards read


def _probe_ids(target: TargetModel, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random token ids for timing forwards, from a few hundred rows of the vocabulary: a forward's cost does not
    depend on which ids it embeds, and ids spread over all of it would page in the whole (mapped) embedding table
    (108 MiB for SmolLM2) for nothing."""
    high = min(max(11, target.vocab_size - 1), 10 + PROBE_ROWS)
    return torch.randint(10, high, shape, generator=g, device=target.device)


def measure_verify_cost(target: TargetModel, sizes=COST_SIZES, context: int = 128, repeats: int = 3) -> dict:
    """Median seconds of one verify forward over k new tokens after `context` cached ones, per k: the decoder
    stack over k rows, then the LM head over the rows a verification reads first (verify/rows.py)."""
    g = torch.Generator(device=target.device).manual_seed(0)
    shape = (1, context + max(sizes))
    ids = _probe_ids(target, shape, g)
    cache = KVCache(device=target.device)  # a plain cache: compressed ones (H2O, windows) are committed, not cropped
    target.forward(ids[:, :context], cache, logits_to_keep=1)
    out = {}
    clock = device_clock(target.device)
    for k in sizes:
        times = []
        for _ in range(repeats + 1):
            t = clock()
            fwd = target.forward(ids[:, context : context + k], cache, defer_logits=True)
            if fwd.final is not None:
                target.head(fwd.final[0, :FIRST_ROWS])
            times.append(clock() - t)
            cache.crop(context)
        out[k] = statistics.median(times[1:])  # the first run warms the kernels for this shape
    del cache
    release_freed_memory()
    return out


def measure_segment_cost(target: TargetModel, segments: int = 8, context: int = 128, repeats: int = 3) -> float:
    """Seconds one more request adds to a packed forward beyond its rows (its own attention, cache appends):
    `segments` requests × 1 row against 1 request × `segments` rows, per extra request (median of a few)."""
    from byblock.models.adapter import SegmentInput

    g = torch.Generator(device=target.device).manual_seed(0)
    ids = _probe_ids(target, (segments, context), g)
    caches = [KVCache(device=target.device) for _ in range(segments)]
    for row, cache in zip(ids, caches, strict=True):
        target.forward(row[None], cache, logits_to_keep=1)
    clock = device_clock(target.device)
    times: dict[int, list[float]] = {1: [], segments: []}
    for _ in range(repeats + 1):
        for n in times:
            per = segments // n
            t = clock()
            target.forward_packed([SegmentInput(c, [11] * per) for c in caches[:n]], [0])
            times[n].append(clock() - t)
            for c in caches[:n]:
                c.crop(context)
    many, one = (statistics.median(times[n][1:]) for n in (segments, 1))
    del caches
    release_freed_memory()  # the probe's eight caches and prefills: ~140 MiB otherwise kept by malloc
    return max(0.0, (many - one) / (segments - 1))


_SEGMENT_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def segment_cost(target: TargetModel) -> float:
    """`measure_segment_cost(target)`, measured once per model (~1 s on this CPU): every batched engine core
    built on the model reuses it, and `generate(model, [prompts])` builds one per call — measuring inside each
    call had put a second of start-up into every batch the benchmark timed (dev/LOG.md, session 33)."""
    cost = _SEGMENT_COSTS.get(target)
    if cost is None:
        cost = _SEGMENT_COSTS[target] = measure_segment_cost(target)
    return cost


@dataclass(frozen=True)
class StepCost:
    """One request's view of the next step: what it costs without this request's round, and the prices of the
    round's rows and of its verifying a draft at all (seconds)."""

    base_s: float
    per_row: float
    per_verify: float
    drafts: bool = True  # False: the engine's gate makes this a plain step for every request (engine/step_costs.py)

    def __post_init__(self) -> None:
        if min(self.base_s, self.per_row, self.per_verify) < 0:
            raise ValueError(f"step costs must be non-negative: {self}")

    def seconds(self, rows: int) -> float:
        """The step's seconds if this request's round puts `rows` rows in it (rows > 1: it verifies a draft)."""
        return self.base_s + self.per_row * rows + (self.per_verify if rows > 1 else 0.0)


class CostModel:
    """Piecewise-linear cost(k) from measured points."""

    def __init__(self, points: dict[int, float]) -> None:
        self.ks = sorted(points)
        # Running max: more rows never cost less. Measured points can dip (16 and 24 rows within noise of each
        # other), and a dip makes the rows in it look free to a batched decision whose others' rows land there.
        self.ts, top = [], 0.0
        for k in self.ks:
            top = max(top, points[k])
            self.ts.append(top)
        # cost(k) per row count asked so far: adaptive drafters ask ~30 times per request and round (a rate per
        # candidate tree size), and the interpolation's search cost more than the rest of the rule
        self._memo: dict[int, float] = {}

    def __call__(self, k: int) -> float:
        cost = self._memo.get(k)
        if cost is None:
            cost = self._memo[k] = self._interpolate(k)
        return cost

    def slope(self, lo: int, hi: int) -> float:
        """Seconds per row between lo and hi rows (>= 0)."""
        return max(0.0, (self(hi) - self(lo)) / (hi - lo))

    def _interpolate(self, k: int) -> float:
        ks, ts = self.ks, self.ts
        if k <= ks[0]:
            return ts[0]
        for (k0, t0), (k1, t1) in zip(zip(ks, ts, strict=True), zip(ks[1:], ts[1:], strict=True), strict=False):
            if k <= k1:
                return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return ts[-1] * k / ks[-1]  # past the last point: proportional
