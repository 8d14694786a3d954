"""An EngineCore for diffusion LMs: the server drives block diffusion exactly as it drives speculative decoding.

Each step decodes one block of the running request (all its denoising forwards) and emits the block's text
as one stream event; requests run one at a time, FIFO, like SerialEngineCore. τ in the result is tokens per
denoising forward (rounds = forwards), so /metrics and the playground report TPF for diffusion models.
The batched diffusion engine (engine/dllm_batched.py) shares BlockStream, so both stop and report alike.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import replace

from byblock.dllm.config import DllmConfig
from byblock.dllm.denoisers import Denoiser
from byblock.dllm.generate import iter_blocks
from byblock.engine.core import EngineRequest, FifoEngineCore, RequestOutput
from byblock.engine.text import IncrementalDetokenizer, StopStringMatcher
from byblock.engine.types import FinishReason, GenerationResult, SpecStats, StreamEvent, TokenEvent


def request_config(base: DllmConfig, req: EngineRequest) -> DllmConfig:
    """The engine's diffusion settings with this request's length, temperature and seed."""
    params = req.params
    return replace(base, max_new_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed)


class BlockStream:
    """One diffusion request's output: decided blocks in; text deltas, the stop decision and the result out
    (EOS, stop strings, max_new_tokens)."""

    def __init__(self, req: EngineRequest, tokenizer, eos: frozenset[int], label: str, block_size: int) -> None:
        self.req = req
        self.eos = eos
        self.label = label
        self.block_size = block_size
        self.start = time.perf_counter()
        self.detok = IncrementalDetokenizer(tokenizer, list(req.prompt_ids))
        self.stops = StopStringMatcher(req.params.stop)
        self.tokens: list[int] = []
        self.nfe, self.ttft, self.finish = 0, 0.0, FinishReason.LENGTH
        self.done = False

    def push(self, block: list[int], steps: int) -> StreamEvent | None:
        """A decided block and the denoising forwards it took -> its text delta (None if it adds nothing)."""
        params = self.req.params
        self.nfe += steps
        now = time.perf_counter() - self.start
        self.ttft = self.ttft or now
        delta, new = "", []
        for tok in block[: params.max_new_tokens - len(self.tokens)]:
            self.tokens.append(tok)
            new.append(TokenEvent(tok, from_draft=False))
            if tok in self.eos and not params.ignore_eos:
                self.finish = FinishReason.STOP
                break
            delta += self.stops.push(self.detok.add(tok))
            if self.stops.stopped:
                self.finish = FinishReason.STOP
                break
        self.done = self.finish is FinishReason.STOP or len(self.tokens) >= params.max_new_tokens
        return StreamEvent(delta, tuple(new), now) if delta or new else None

    def close(self) -> StreamEvent | None:
        """Text held back for a stop string that never came."""
        tail = self.stops.flush()
        return StreamEvent(tail, (), time.perf_counter() - self.start) if tail else None

    def result(self) -> GenerationResult:
        """The request's result (τ = tokens per denoising forward)."""
        n = len(self.tokens)
        return GenerationResult(
            text=self.stops.text,
            token_ids=self.tokens,
            from_draft=[False] * n,
            prompt_tokens=len(self.req.prompt_ids),
            finish_reason=self.finish,
            ttft_s=self.ttft,
            total_s=time.perf_counter() - self.start,
            drafter=self.label,
            block_size=self.block_size,
            stats=SpecStats(rounds=self.nfe, emitted_by_rounds=n),
        )


class DllmEngineCore(FifoEngineCore):
    """One diffusion request at a time; one block per step."""

    def __init__(self, denoiser: Denoiser, tokenizer, eos_token_ids: frozenset[int], base: DllmConfig) -> None:
        super().__init__()
        self.denoiser = denoiser
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.base = base
        self.label = f"dllm-{base.sampler.value}"

    def _outputs(self, req: EngineRequest) -> Generator[RequestOutput, None, None]:
        """The request as a sequence of outputs: one text delta per block, then the result."""
        cfg = request_config(self.base, req)
        out = BlockStream(req, self.tokenizer, self.eos, self.label, cfg.block_size or self.denoiser.default_block_size)
        blocks = iter_blocks(self.denoiser, list(req.prompt_ids), cfg)
        try:
            for block, steps in blocks:
                if (event := out.push(block, steps)) is not None:
                    yield RequestOutput(req.request_id, event=event)
                if out.done:
                    break
        finally:
            blocks.close()
        if (tail := out.close()) is not None:
            yield RequestOutput(req.request_id, event=tail)
        yield RequestOutput(req.request_id, result=out.result())
