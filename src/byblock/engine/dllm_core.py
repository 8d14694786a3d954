"""An EngineCore for diffusion LMs: the server drives block diffusion exactly as it drives speculative decoding.

Each step decodes one block of the running request (all its denoising forwards) and emits the block's text
as one stream event; requests run one at a time, FIFO, like SerialEngineCore. τ in the result is tokens per
denoising forward (rounds = forwards), so /metrics and the playground report TPF for diffusion models.
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
