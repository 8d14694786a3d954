"""Semi-autoregressive block diffusion, one loop for every sampler:

    commit(prompt)
    for each block of B tokens:
        canvas ← all MASK (mask samplers) | uniform random tokens (renoise)
        repeat: logits ← denoise(canvas) ; the sampler updates the canvas    (NFE += 1)
        until the block is decided (no MASK left | stable and confident | step cap)
        emit the block (cut at EOS) ; commit(block)                          (one causal-cache pass)

TPF (tokens per forward) = emitted tokens / denoising forwards: what a sampler must push above the cost
ratio of a canvas forward to an AR step to be faster than AR decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from byblock.dllm.config import MASK_SAMPLERS, DllmConfig, SamplerKind
from byblock.dllm.denoisers import Denoiser
from byblock.dllm.mask_step import MaskBlock
from byblock.dllm.renoise import init_state, renoise_step
from byblock.errors import InvalidParameterError
from byblock.sampling.processors import make_generator


@dataclass(frozen=True)
class DllmResult:
    """What one diffusion request produced."""

    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    nfe: int  # denoising forwards
    commits: int  # block commit forwards (the exact KV cache's extra passes)
    steps_per_block: list[int] = field(default_factory=list)
    total_s: float = 0.0

    @property
    def tpf(self) -> float:
        """Tokens per denoising forward."""
        return len(self.token_ids) / self.nfe if self.nfe else 0.0

    def to_json(self) -> dict:
        """The `--json` fields of a diffusion generation."""
        return {
            "token_ids": self.token_ids,
            "num_new_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "nfe": self.nfe,
            "commits": self.commits,
            "tpf": round(self.tpf, 4),
            "steps_per_block": self.steps_per_block,
            "total_s": round(self.total_s, 6),
        }


def check_sampler(model: Denoiser, cfg: DllmConfig) -> None:
    """A one-line error when the sampler cannot drive this model."""
    if cfg.sampler in MASK_SAMPLERS and model.mask_token_id is None:
        raise InvalidParameterError(
            f"sampler '{cfg.sampler.value}' needs a mask token; this model uses --sampler renoise"
        )
    if cfg.sampler is SamplerKind.RENOISE and model.mask_token_id is not None:
        raise InvalidParameterError("--sampler renoise is for uniform-state models (DiffusionGemma)")


def iter_blocks(model: Denoiser, prompt_ids: list[int], cfg: DllmConfig) -> Iterator[tuple[list[int], int]]:
    """Yield (block tokens, denoising steps) block after block, forever; the caller stops it (EOS, length).

    Each block is committed to the session only when the next one is asked for, so the last block of a
    request never costs a commit pass."""
    check_sampler(model, cfg)
    device = model.device
    generator = make_generator(cfg.seed, device)
    block = cfg.block_size or model.default_block_size
    session = model.session(torch.tensor([prompt_ids], device=device), cfg.cache)
    last_block: list[int] = []
    while True:
        if last_block:
            session.commit(torch.tensor([last_block], device=device))
        if cfg.sampler is SamplerKind.RENOISE:
            last_block, steps = _renoise_block(session, model, block, cfg, generator)
        else:
            last_block, steps = _mask_block(session, model, block, cfg, generator)
        yield last_block, steps


def diffusion_generate(
    model: Denoiser, prompt_ids: list[int], cfg: DllmConfig, eos_token_ids: set[int] | frozenset[int] = frozenset()
) -> DllmResult:
    """Decode up to cfg.max_new_tokens after the prompt, block by block (batch of one request)."""
    start = time.perf_counter()
    out: list[int] = []
    steps_per_block: list[int] = []
    finish = "length"
    blocks = iter_blocks(model, prompt_ids, cfg)
    for result, steps in blocks:
        steps_per_block.append(steps)
        for tok in result[: cfg.max_new_tokens - len(out)]:
            out.append(tok)
            if tok in eos_token_ids:
                finish = "stop"
                break
        if finish == "stop" or len(out) >= cfg.max_new_tokens:
            break
    blocks.close()
    nfe = sum(steps_per_block)
    return DllmResult(out, finish, nfe, len(steps_per_block) - 1, steps_per_block, time.perf_counter() - start)


def _mask_block(session, model: Denoiser, block: int, cfg: DllmConfig, generator) -> tuple[list[int], int]:
    """Fill one all-MASK canvas; every step reveals >= 1 token, so at most `block` steps (or cfg.steps)."""
    assert model.mask_token_id is not None
    state = MaskBlock(cfg, block, model.mask_token_id, generator, session.device)
    while not state.done:
        state.step(session.denoise(state.canvas, None))  # [1, L, V]
    return state.canvas[0].tolist(), state.steps


def _renoise_block(session, model: Denoiser, block: int, cfg: DllmConfig, generator) -> tuple[list[int], int]:
    """Denoise one uniform-random canvas until stable and confident, or N steps; emit its argmax."""
    n = cfg.steps or 48
    state = init_state(1, block, model.vocab_size, cfg.stability, generator, session.device)
    steps = 0
    for cur_step in range(n, 0, -1):
        logits = session.denoise(state.canvas, state.self_cond)
        renoise_step(state, logits, cur_step, cfg, generator)
        steps += 1
        if bool(state.done.all()):
            break
    return state.argmax[0].tolist(), steps
