"""The request-level API: prompt in, text deltas out. Tokenization, stopping rules, timing, stats.

Both decoding loops yield tokens one at a time and are stopped by closing them, so every method stops at
exactly the same token (EOS, stop string, max tokens, context end) — even in the middle of a block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from byblock.drafters.base import Drafter
from byblock.engine.plain import plain_decode
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.text import IncrementalDetokenizer, StopStringMatcher
from byblock.engine.types import FinishReason, GenerationResult, SpecStats, StreamEvent, TokenEvent
from byblock.errors import ContextLengthError
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import make_generator


def check_prompt_fits(model: TargetModel, prompt_ids: list[int]) -> None:
    """Raise ContextLengthError unless the prompt is non-empty and leaves room for at least one new token."""
    if not prompt_ids:
        raise ContextLengthError("the prompt is empty after tokenization")
    if len(prompt_ids) >= model.max_context:
        raise ContextLengthError(
            f"prompt is {len(prompt_ids)} tokens; model '{model.name}' has a context of "
            f"{model.max_context}, leaving no room to generate"
        )


class Generation:
    """One request. Iterate it for StreamEvents; afterwards `.result` holds the GenerationResult."""

    def __init__(
        self,
        model: TargetModel,
        prompt: str | list[int],
        params: SamplingParams,
        drafter: Drafter | None = None,
        chat: bool = True,
    ) -> None:
        self.model = model
        self.params = params
        self.drafter = drafter
        self.prompt_ids = model.encode_prompt(prompt, chat) if isinstance(prompt, str) else list(prompt)
        check_prompt_fits(model, self.prompt_ids)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamEvent]:
        model, params = self.model, self.params
        start = time.perf_counter()
        generator = make_generator(params.seed, model.device)
        stats = SpecStats()
        if self.drafter is None:
            loop = plain_decode(model, self.prompt_ids, params, generator, stats)
        else:
            loop = speculative_decode(model, self.drafter, self.prompt_ids, params, generator, stats)
        detok = IncrementalDetokenizer(model.tokenizer, self.prompt_ids)
        stops = StopStringMatcher(params.stop)
        token_ids: list[int] = []
        from_draft: list[bool] = []
        pending: list[TokenEvent] = []
        ttft = 0.0
        room = min(params.max_new_tokens, model.max_context - len(self.prompt_ids))
        finish = FinishReason.LENGTH
        try:
            for ev in loop:
                if not token_ids:
                    ttft = time.perf_counter() - start
                token_ids.append(ev.token_id)
                from_draft.append(ev.from_draft)
                pending.append(ev)
                if ev.token_id in model.eos_token_ids and not params.ignore_eos:
                    finish = FinishReason.STOP
                    break
                delta = stops.push(detok.add(ev.token_id))
                if stops.stopped:
                    finish = FinishReason.STOP
                    if delta:
                        yield StreamEvent(delta, tuple(pending), time.perf_counter() - start)
                    pending = []
                    break
                if delta:
                    yield StreamEvent(delta, tuple(pending), time.perf_counter() - start)
                    pending = []
                if len(token_ids) >= room:
                    break
        finally:
            loop.close()
        tail = stops.flush()
        if tail or pending:
            yield StreamEvent(tail, tuple(pending), time.perf_counter() - start)
        drafter = self.drafter
        self.result = GenerationResult(
            text=stops.text,
            token_ids=token_ids,
            from_draft=from_draft,
            prompt_tokens=len(self.prompt_ids),
            finish_reason=finish,
            ttft_s=ttft,
            total_s=time.perf_counter() - start,
            drafter=drafter.name if drafter is not None else "none",
            block_size=drafter.block_size if drafter is not None else 1,
            stats=stats,
        )


def stream(
    model: TargetModel,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    *,
    drafter: Drafter | None = None,
    chat: bool = True,
) -> Generation:
    """Start a request; iterate the returned Generation for text deltas (its `.result` once exhausted)."""
    return Generation(model, prompt, params or SamplingParams(), drafter, chat)


def generate(
    model: TargetModel,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    *,
    drafter: Drafter | None = None,
    chat: bool = True,
) -> GenerationResult:
    """Run a request to completion and return its GenerationResult."""
    gen = stream(model, prompt, params, drafter=drafter, chat=chat)
    for _ in gen:
        pass
    assert gen.result is not None
    return gen.result
