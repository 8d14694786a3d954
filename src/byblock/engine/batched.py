"""The batched engine: many requests per target forward, plain and speculative, each exactly its solo output.

One `step()` is the whole flow (nano-vllm's shape):

    schedule   preempt for the KV budget; the next chunk of prompts being prefilled; admit waiting requests
               (engine/scheduler.py)
    draft      every running request proposes its own draft (its own drafter fork): chains, trees, nothing
    run        one packed forward over every request's rows: prompts, plain steps, ragged verify blocks, each
               against its own cache (models/adapter.py forward_packed, kernels/ragged.py); the LM head runs
               once over the rows verification reads first
    sample     per request: choose / verify with its own generator, commit its accepted slots, observe
    emit       text deltas through each request's OutputProcessor; finished requests leave the batch

Adaptive drafters size their drafts from the engine's own prices, a fit of the steps it ran, and draft at all
only while steps that may draft beat steps where every request rests, by the clock (engine/step_costs.py).

Why each request gets exactly its solo tokens: its rows meet other requests' rows only in the linears, which
are row-invariant (byblock's packed fp32 GEMM: every output is one FMA chain over k, whatever the row count);
attention, sampling and drafting are per request, in the single-request loops' order. So in fp32 on the packed
kernels a request's greedy output, and its seeded sampled output, equal what `generate` produces for it alone
(tests/test_batch_exact.py). Library kernels (bf16 without the invariant rules, a GPU's GEMMs) are not
row-invariant: there a batched request is lossless (identical in law) but may differ from its solo run at
near-ties. A preempted request is recomputed, with the same caveat (engine/scheduler.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from byblock.drafters.base import Drafter
from byblock.drafters.costs import segment_cost
from byblock.drafters.dflash import draft_blocks
from byblock.engine.api import check_prompt_fits
from byblock.engine.core import EngineRequest, RequestOutput
from byblock.engine.scheduler import BatchConfig, Scheduler
from byblock.engine.sequence import Phase, Round, Sequence
from byblock.engine.step_costs import DraftGate, StepCostFit
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.models.devices import device_clock


@dataclass(frozen=True)
class StepStats:
    """What the last step ran (the server's batch metrics)."""

    seqs: int = 0  # requests in the forward
    rows: int = 0  # packed rows
    prefills: int = 0
    forward_s: float = 0.0


class BatchedEngineCore:
    """EngineCore over continuous batching (see the module docstring)."""

    def __init__(
        self, model: TargetModel, drafters: Mapping[str, Drafter | None], config: BatchConfig | None = None
    ) -> None:
        self.model = model
        self.drafters = {"none": None, **drafters}
        self.drafter_names = tuple(self.drafters)
        self.config = config or BatchConfig()
        self.scheduler = Scheduler(self.config, chunk_exact=not model.row_invariant)
        self._seqs: dict[str, Sequence] = {}
        self._failed: list[RequestOutput] = []  # requests refused at add time, reported by the next step
        self.clock = device_clock(model.device)
        # CPU: the LM head runs on the rows a verification reads (verify/rows.py); on a GPU every row costs one.
        self.lazy_head = model.device.type == "cpu" and model.defers_logits()
        self.last_step = StepStats()
        # What one more request costs a forward beyond its rows, for adaptive drafters' batch-aware sizing.
        adaptive = [d for d in self.drafters.values() if hasattr(d, "set_batch_load")]
        self.segment_s = segment_cost(model) if adaptive else 0.0
        self._shares: dict[str, float] = {}  # request id -> its share of the last batched drafter forward
        # The prices of a step, fitted from the steps this engine runs (engine/step_costs.py), for adaptive
        # drafters once it has seen enough; until then they size drafts from their probed cost(k).
        self.step_fit = self._step_fit(adaptive[0]) if adaptive else None
        self.gate = DraftGate() if adaptive else None  # whether they may draft at all, by the clock
        self._gated = False  # this step's drafters were handed the gate's mode
        self._draft_s: dict[str, float] = {}  # request id -> its round's drafting seconds in the last step

    # -- the EngineCore contract -------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; a bad one is answered by the next step with an error output."""
        try:
            if request.drafter not in self.drafters:
                raise ByblockError(f"drafter '{request.drafter}' is not loaded")
            ids = list(request.prompt_ids)
            check_prompt_fits(self.model, ids)
            base = self.drafters[request.drafter]
            seq = Sequence(
                request.request_id,
                ids,
                request.params,
                self.model,
                base.fork() if base is not None else None,
                time.perf_counter(),
            )
        except ByblockError as e:  # e.g. a logit_bias id outside the vocabulary
            self._failed.append(RequestOutput(request.request_id, error=str(e)))
            return
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Drop a request, queued or running; its cache is freed at once."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.remove(seq)
        self._failed = [f for f in self._failed if f.request_id != request_id]

    def has_unfinished(self) -> bool:
        """True while a request is queued or running (or a refusal is still to be reported)."""
        return bool(self._seqs) or bool(self._failed)

    def num_waiting(self) -> int:
        """Requests queued (preempted ones included)."""
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        """Requests in the batch."""
        return len(self.scheduler.running)

    def kv_usage(self) -> tuple[int, int | None]:
        """(cache slots held, the KV budget or None)."""
        return self.scheduler.kv_tokens(), self.config.max_kv_tokens

    @property
    def preemptions(self) -> int:
        """Requests preempted (their caches dropped and recomputed) since start."""
        return self.scheduler.preemptions

    # -- one step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, draft, run one packed forward, sample, emit (see the module docstring)."""
        outputs, self._failed = self._failed, []
        step_t0 = self.clock()
        sched = self.scheduler
        slack = {rid: seq.max_rows for rid, seq in self._seqs.items()}
        sched.preempt_for_kv(slack)
        live = [s for s in sched.running if s.phase is Phase.RUNNING]
        shares = self._draft_blocks(live, outputs)
        rounds: list[tuple[Sequence, Round]] = []
        for seq in live:
            if seq.request_id not in self._seqs:  # failed while drafting
                continue
            try:
                rounds.append((seq, seq.plan(self.lazy_head, self.clock, shares.get(seq.request_id, 0.0))))
            except Exception as e:  # a drafter's failure fails its request, never the batch
                outputs.append(self._fail(seq, e))
        rows = sum(len(r.segment.input_ids) for _, r in rounds)
        chunks = sched.prefills(rows)
        chunks += sched.admit(rows + sum(n for _, n in chunks), slack)
        rounds += [(seq, seq.plan_prefill(n)) for seq, n in chunks]
        if not rounds:
            return outputs
        starts, logits_rows, layers, total = [], [], set(), 0
        for seq, rnd in rounds:
            t = len(rnd.segment.input_ids)
            starts.append(total)
            first = total + t - 1 if rnd.prefill else total  # a prompt's last row; a round's first rows
            logits_rows.extend(range(first, first + rnd.rows))
            if seq.drafter is not None:
                layers.update(seq.drafter.hidden_layers)
            total += t
        keep_final = self.lazy_head and any(r.draft is not None and r.rows < r.draft.num_nodes + 1 for _, r in rounds)
        t0 = self.clock()
        try:
            union = tuple(sorted(layers))
            out = self.model.forward_packed(
                [r.segment for _, r in rounds], logits_rows, hidden_layers=union, keep_final=keep_final
            )
        except Exception as e:  # a bug in the forward fails this step's requests, never the engine thread
            return outputs + [self._fail(seq, e) for seq, _ in rounds]
        forward_s = self.clock() - t0
        self.last_step = StepStats(len(rounds), total, sum(r.prefill for _, r in rounds), forward_s)
        at, emitted = 0, 0
        for (seq, rnd), start in zip(rounds, starts, strict=True):
            first_logits = out.logits[at : at + rnd.rows]
            at += rnd.rows
            t1 = self.clock()
            try:
                events = seq.finish(rnd, out, start, first_logits, forward_s, union)
            except Exception as e:
                outputs.append(self._fail(seq, e))
                continue
            if rnd.draft is not None and seq.observe_host is not None:
                seq.observe_host(self.clock() - t1)  # adaptive drafters charge a deep round's extra finishing work
            emitted += 0 if rnd.prefill else len(events)
            outputs.extend(self._emit(seq, events))
        if self.step_fit is not None:
            self._fit_step(rounds, self.clock() - step_t0, emitted)
        return outputs

    def _step_fit(self, drafter) -> StepCostFit:
        """The step-cost fit, its prior from a drafter's probed costs: a one-row forward, the curve's slope over
        4..16 rows, one segment's extra (drafters/costs.py); verifying's own host work starts at 0."""
        cost = drafter.cost
        per_row = cost.slope(4, 16)
        return StepCostFit((cost(1), self.segment_s, per_row, per_row, 0.0))

    def _fit_step(self, rounds: list[tuple[Sequence, Round]], seconds: float, emitted: int) -> None:
        """One finished step into the fit (its seconds without the rounds' own drafting, and its shape) and, if
        its drafters were gated, into the gate (its decode tokens, its seconds without the fitted prefill)."""
        assert self.step_fit is not None and self.gate is not None
        decode = prefill = verifying = 0
        drafting = 0.0
        self._draft_s = {}
        for seq, rnd in rounds:
            t = len(rnd.segment.input_ids)
            if rnd.prefill:
                prefill += t
                continue
            decode += t
            verifying += int(t > 1)
            drafting += rnd.draft_s
            self._draft_s[seq.request_id] = rnd.draft_s
        self.step_fit.add(max(0.0, seconds - drafting), len(rounds), decode, prefill, verifying)
        if self._gated:
            self.gate.add(emitted, seconds - self.step_fit.prefill_s(prefill))

    def _draft_blocks(self, live: list[Sequence], outputs: list[RequestOutput]) -> dict[str, float]:
        """Every DFlash-backed drafter's block of this step in one drafter forward (drafters/dflash.py
        draft_blocks); adaptive drafters first learn the load the rest of the batch puts on the forward.
        Returns each request's share of the forward's seconds."""
        rows = sum(s.last_rows for s in live)
        emitted = sum(s.last_emitted for s in live)
        drafting = sum(self._shares.values())
        fit = self.step_fit if self.step_fit is not None and self.step_fit.ready else None
        self._gated = fit is not None and len(live) > 1
        drafts = self.gate.drafts if self.gate is not None else True
        verifying = sum(s.last_rows > 1 for s in live)
        spent = sum(self._draft_s.get(s.request_id, 0.0) for s in live)
        requests, ids = [], []
        for seq in live:
            try:
                if seq.set_batch_load is not None:
                    rid = seq.request_id
                    others_s = (len(live) - 1) * self.segment_s + drafting - self._shares.get(rid, 0.0)
                    cost = None
                    if fit is not None and len(live) > 1:
                        mine = seq.last_rows > 1
                        own_s = self._draft_s.get(rid, 0.0)
                        others = (rows - seq.last_rows, verifying - mine, spent - own_s)
                        cost = fit.for_request(len(live), *others, drafts=drafts)
                    seq.set_batch_load(rows - seq.last_rows, emitted - seq.last_emitted, others_s, cost)
                if (req := seq.block_request()) is not None:
                    requests.append(req)
                    ids.append(seq.request_id)
            except Exception as e:
                outputs.append(self._fail(seq, e))
        self._shares = {}
        if not requests:
            return {}
        t0 = self.clock()
        try:
            draft_blocks(requests)
        except Exception as e:  # a drafter bug fails the requests it drafted for, never the engine thread
            outputs.extend(self._fail(self._seqs[rid], e) for rid in ids)
            return {}
        share = (self.clock() - t0) / len(requests)
        self._shares = dict.fromkeys(ids, share)
        return self._shares

    def _emit(self, seq: Sequence, events) -> list[RequestOutput]:
        """The step's text for one request, and its result when it is done."""
        proc = seq.output
        deltas = [d for d in (proc.push(ev) for ev in events) if d is not None]
        if proc.done:
            tail = proc.close()
            if tail is not None:
                deltas.append(tail)
        # One output per delta, as the FIFO engine streams them: a client sees which text came from drafts.
        outs = [RequestOutput(seq.request_id, event=d) for d in deltas]
        if proc.done:
            result = proc.result(seq.drafter, seq.stats)
            outs.append(RequestOutput(seq.request_id, result=result))
            self._release(seq)
        return outs

    def _fail(self, seq: Sequence, e: Exception) -> RequestOutput:
        self._release(seq)
        if isinstance(e, ByblockError):
            return RequestOutput(seq.request_id, error=str(e))
        return RequestOutput(seq.request_id, error=f"internal error: {type(e).__name__}: {e}", internal=True)

    def _release(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
