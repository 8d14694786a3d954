"""The request-level API: prompt in, text deltas out. Tokenization, stopping rules, timing, stats.

Both decoding loops yield tokens one at a time and are stopped by closing them, so every method stops at
exactly the same token (EOS, stop string, max tokens, context end) — even in the middle of a block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from byblock.drafters.base import Drafter
from byblock.engine.output import OutputProcessor
from byblock.engine.plain import plain_decode
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.types import GenerationResult, SpecStats, StreamEvent
from byblock.errors import ByblockError, ContextLengthError, InvalidParameterError
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import make_generator

if TYPE_CHECKING:
    from byblock.engine.scheduler import BatchConfig
    from byblock.verify.specguard import SpecGuardConfig


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
        guard: SpecGuardConfig | None = None,
    ) -> None:
        """guard: SpecGuard's step-level acceptance for the drafter's chains (lossy, verify/specguard.py)."""
        if guard is not None and drafter is None:
            raise InvalidParameterError("--verify specguard needs a drafter")
        self.model = model
        self.params = params
        self.drafter = drafter
        self.guard = guard
        self.prompt_ids = model.encode_prompt(prompt, chat) if isinstance(prompt, str) else list(prompt)
        check_prompt_fits(model, self.prompt_ids)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamEvent]:
        model, params = self.model, self.params
        out = OutputProcessor(model, self.prompt_ids, params, time.perf_counter())
        generator = make_generator(params.seed, model.device)
        stats = SpecStats()
        if self.drafter is None:
            loop = plain_decode(model, self.prompt_ids, params, generator, stats)
        else:
            loop = speculative_decode(model, self.drafter, self.prompt_ids, params, generator, stats, self.guard)
        try:
            for ev in loop:
                delta = out.push(ev)
                if delta is not None:
                    yield delta
                if out.done:
                    break
        finally:
            loop.close()
        tail = out.close()
        if tail is not None:
            yield tail
        self.result = out.result(self.drafter, stats)


def stream(
    model: TargetModel,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    *,
    drafter: Drafter | None = None,
    chat: bool = True,
    guard: SpecGuardConfig | None = None,
) -> Generation:
    """Start a request; iterate the returned Generation for text deltas (its `.result` once exhausted).
    guard: SpecGuard's lossy step-level acceptance (verify/specguard.py); None: lossless."""
    return Generation(model, prompt, params or SamplingParams(), drafter, chat, guard)


def generate(
    model: TargetModel,
    prompt: str | list[int] | Sequence[str | list[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    drafter: Drafter | None = None,
    chat: bool = True,
    batch: BatchConfig | None = None,
    guard: SpecGuardConfig | None = None,
) -> GenerationResult | list[GenerationResult]:
    """Run a request to completion and return its GenerationResult.

    A list of prompts (strings or token-id lists) is decoded together by the batched engine
    (engine/batched.py), with one SamplingParams for all or one per prompt, and returns one result per prompt
    in order (vLLM's `LLM.generate` shape). Each gets the tokens it would get alone; `drafter` is forked per
    request (Drafter.fork), so the object passed in keeps no request's state. guard: SpecGuard's step-level
    acceptance (one prompt; NOT lossless, verify/specguard.py)."""
    if _is_batch(prompt):
        if guard is not None:
            raise InvalidParameterError("SpecGuard runs one request at a time (no batched prompts)")
        return generate_batch(model, list(prompt), params, drafter=drafter, chat=chat, batch=batch)
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidParameterError("one prompt takes one SamplingParams")
    gen = stream(model, prompt, params, drafter=drafter, chat=chat, guard=guard)  # type: ignore[arg-type]
    for _ in gen:
        pass
    assert gen.result is not None
    return gen.result


def _is_batch(prompt: object) -> bool:
    """A list of prompts (not one prompt's token ids)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and not isinstance(prompt[0], int)


def generate_batch(
    model: TargetModel,
    prompts: list[str | list[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    *,
    drafter: Drafter | None = None,
    chat: bool = True,
    batch: BatchConfig | None = None,
) -> list[GenerationResult]:
    """Decode `prompts` together with the batched engine; one GenerationResult per prompt, in order."""
    from byblock.engine.batched import BatchedEngineCore
    from byblock.engine.core import EngineRequest

    if params is None or isinstance(params, SamplingParams):
        per = [params or SamplingParams()] * len(prompts)
    else:
        per = list(params)
        if len(per) != len(prompts):
            raise InvalidParameterError(f"{len(prompts)} prompts but {len(per)} SamplingParams")
    ids = [model.encode_prompt(p, chat) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for one in ids:
        check_prompt_fits(model, one)
    core = BatchedEngineCore(model, {"drafter": drafter} if drafter is not None else {}, batch)
    name = "drafter" if drafter is not None else "none"
    for i, (one, p) in enumerate(zip(ids, per, strict=True)):
        core.add_request(EngineRequest(str(i), tuple(one), p, name))
    results: dict[str, GenerationResult] = {}
    while core.has_unfinished():
        for out in core.step():
            if out.error is not None:
                raise ByblockError(f"prompt {out.request_id}: {out.error}")
            if out.result is not None:
                results[out.request_id] = out.result
    return [results[str(i)] for i in range(len(prompts))]
