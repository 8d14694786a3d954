"""An EngineCore for diffusion LMs: the server drives block diffusion exactly as it drives speculative decoding.

Each step decodes one block of the running request (all its denoising forwards) and emits the block's text
as one stream event; requests run one at a time, FIFO, like SerialEngineCore. τ in the result is tokens per
denoising forward (rounds = forwards), so /metrics and the playground report TPF for diffusion models.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace

from byblock.dllm.config import DllmConfig
from byblock.dllm.denoisers import Denoiser
from byblock.dllm.generate import iter_blocks
from byblock.engine.core import EngineRequest, RequestOutput
from byblock.engine.text import IncrementalDetokenizer, StopStringMatcher
from byblock.engine.types import FinishReason, GenerationResult, SpecStats, StreamEvent, TokenEvent
from byblock.errors import ByblockError


class DllmEngineCore:
    """One diffusion request at a time; one block per step."""

    drafter_names = ("none",)

    def __init__(self, denoiser: Denoiser, tokenizer, eos_token_ids: frozenset[int], base: DllmConfig) -> None:
        self.denoiser = denoiser
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.base = base
        self.label = f"dllm-{base.sampler.value}"
        self._waiting: deque[EngineRequest] = deque()
        self._running: tuple[EngineRequest, Iterator[RequestOutput]] | None = None

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request."""
        self._waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Drop a queued request or stop the running one between blocks."""
        if self._running is not None and self._running[0].request_id == request_id:
            self._running[1].close()  # type: ignore[attr-defined]
            self._running = None
            return
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)

    def has_unfinished(self) -> bool:
        """True while a request is queued or running."""
        return self._running is not None or bool(self._waiting)

    def num_waiting(self) -> int:
        """Requests queued behind the running one."""
        return len(self._waiting)

    def num_running(self) -> int:
        """0 or 1."""
        return int(self._running is not None)

    def step(self) -> list[RequestOutput]:
        """Start the next request if idle, then decode one block of it."""
        if self._running is None:
            if not self._waiting:
                return []
            req = self._waiting.popleft()
            self._running = (req, self._decode(req))
        req, it = self._running
        try:
            out = next(it)
        except StopIteration:
            self._running = None
            return []
        except ByblockError as e:
            self._running = None
            return [RequestOutput(req.request_id, error=str(e))]
        except Exception as e:  # a bug fails one request, never the engine thread
            self._running = None
            return [RequestOutput(req.request_id, error=f"internal error: {type(e).__name__}: {e}", internal=True)]
        if out.finished:
            self._running = None
        return [out]

    def _decode(self, req: EngineRequest) -> Iterator[RequestOutput]:
        """The request as a sequence of outputs: one text delta per block, then the result."""
        params = req.params
        cfg = replace(self.base, max_new_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed)
        start = time.perf_counter()
        detok = IncrementalDetokenizer(self.tokenizer, list(req.prompt_ids))
        stops = StopStringMatcher(params.stop)
        tokens: list[int] = []
        nfe, ttft, finish = 0, 0.0, FinishReason.LENGTH
        blocks = iter_blocks(self.denoiser, list(req.prompt_ids), cfg)
        try:
            for block, steps in blocks:
                nfe += steps
                ttft = ttft or time.perf_counter() - start
                delta, new = "", []
                for tok in block[: params.max_new_tokens - len(tokens)]:
                    tokens.append(tok)
                    new.append(TokenEvent(tok, from_draft=False))
                    if tok in self.eos and not params.ignore_eos:
                        finish = FinishReason.STOP
                        break
                    delta += stops.push(detok.add(tok))
                    if stops.stopped:
                        finish = FinishReason.STOP
                        break
                if delta or new:
                    yield RequestOutput(
                        req.request_id, event=StreamEvent(delta, tuple(new), time.perf_counter() - start)
                    )
                if finish is FinishReason.STOP or len(tokens) >= params.max_new_tokens:
                    break
        finally:
            blocks.close()
        tail = stops.flush()
        if tail:
            yield RequestOutput(req.request_id, event=StreamEvent(tail, (), time.perf_counter() - start))
        stats = SpecStats(rounds=nfe, emitted_by_rounds=len(tokens))
        result = GenerationResult(
            text=stops.text,
            token_ids=tokens,
            from_draft=[False] * len(tokens),
            prompt_tokens=len(req.prompt_ids),
            finish_reason=finish,
            ttft_s=ttft,
            total_s=time.perf_counter() - start,
            drafter=self.label,
            block_size=cfg.block_size or self.denoiser.default_block_size,
            stats=stats,
        )
        yield RequestOutput(req.request_id, result=result)
