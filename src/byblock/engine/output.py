"""One request's tokens -> text deltas and its GenerationResult: stopping rules, detokenization, timing.

Shared by the single-request loop (`engine/api.py`) and the batched engine (`engine/batched.py`), so every
engine stops at exactly the same token — EOS, stop string, max tokens or the context end — even in the middle
of an accepted block, and streams the same text.
"""

from __future__ import annotations

import time

from byblock.drafters.base import Drafter
from byblock.engine.text import IncrementalDetokenizer, StopStringMatcher
from byblock.engine.types import FinishReason, GenerationResult, SpecStats, StreamEvent, TokenEvent
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams


class OutputProcessor:
    """Feed tokens with `push` until `done`; then `close` for the tail and `result` for the summary."""

    def __init__(self, model: TargetModel, prompt_ids: list[int], params: SamplingParams, start: float) -> None:
        """start: perf_counter time the request's clock starts at (TTFT and total are measured from it)."""
        self.params = params
        self.start = start
        self.eos = model.eos_token_ids
        self.stop_ids = frozenset(params.stop_token_ids)
        self.prompt_tokens = len(prompt_ids)
        self.detok = IncrementalDetokenizer(model.tokenizer, prompt_ids)
        self.stops = StopStringMatcher(params.stop)
        self.room = min(params.max_new_tokens, model.max_context - len(prompt_ids))
        self.token_ids: list[int] = []
        self.from_draft: list[bool] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.pending: list[TokenEvent] = []  # tokens whose text has not been streamed yet
        self.ttft = 0.0
        self.finish = FinishReason.LENGTH
        self.done = False

    def push(self, ev: TokenEvent) -> StreamEvent | None:
        """Add one token (ignored once done); returns a text delta when the token completes some text."""
        if self.done:
            return None
        now = time.perf_counter()
        if not self.token_ids:
            self.ttft = now - self.start
        self.token_ids.append(ev.token_id)
        self.from_draft.append(ev.from_draft)
        if self.logprobs is not None:
            self.logprobs.append(ev.logprob)
        self.pending.append(ev)
        if (ev.token_id in self.eos and not self.params.ignore_eos) or ev.token_id in self.stop_ids:
            self.finish, self.done = FinishReason.STOP, True
            return None
        delta = self.stops.push(self.detok.add(ev.token_id))
        if self.stops.stopped:
            self.finish, self.done = FinishReason.STOP, True
        elif len(self.token_ids) >= self.room:
            self.done = True
        if not delta:
            return None
        event = StreamEvent(delta, tuple(self.pending), now - self.start)
        self.pending = []
        return event

    def close(self) -> StreamEvent | None:
        """The held-back tail (text that could have grown into a stop string) and tokens not yet streamed."""
        tail = self.stops.flush()
        if not tail and not self.pending:
            return None
        event = StreamEvent(tail, tuple(self.pending), time.perf_counter() - self.start)
        self.pending = []
        return event

    def result(self, drafter: Drafter | None, stats: SpecStats) -> GenerationResult:
        """Everything the request produced (drafter: the one that decoded it, None for plain decoding)."""
        return GenerationResult(
            text=self.stops.text,
            token_ids=self.token_ids,
            from_draft=self.from_draft,
            prompt_tokens=self.prompt_tokens,
            finish_reason=self.finish,
            ttft_s=self.ttft,
            total_s=time.perf_counter() - self.start,
            drafter=drafter.name if drafter is not None else "none",
            block_size=drafter.block_size + 1 if drafter is not None else 1,  # the anchor + what it drafts
            stats=stats,
            logprobs=self.logprobs,
        )
