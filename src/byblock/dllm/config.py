"""Typed configuration of diffusion decoding: which sampler, its knobs, block and cache handling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from byblock.errors import InvalidParameterError


class SamplerKind(Enum):
    """How a denoising step decides which canvas positions to keep."""

    LOW_CONFIDENCE = "low-confidence"  # LLaDA: a fixed schedule of k tokens per step, most confident first
    THRESHOLD = "threshold"  # Fast-dLLM: every masked token with confidence >= τ (at least one)
    FACTOR = "factor"  # Fast-dLLM: the top-n whose n-th confidence >= 1 - f/(n+1)
    ENTROPY = "entropy"  # EB-Sampler: lowest-entropy tokens while Σ H - max H <= γ
    RENOISE = "renoise"  # DiffusionGemma: entropy bound, renoise the rest to random tokens, anneal T


class CacheMode(Enum):
    """How committed blocks are attended to."""

    EXACT = "exact"  # each finished block is written to the KV cache by one pass; canvases only read it
    NONE = "none"  # every step recomputes prompt + committed blocks + canvas (the reference for EXACT)
    PREFIX = "prefix"  # Fast-dLLM prefix cache for fully bidirectional models: prefix K/V computed at block start
    # and reused while the canvas changes — an approximation (its drift is measured, tests/test_dllm.py)


MASK_SAMPLERS = (SamplerKind.LOW_CONFIDENCE, SamplerKind.THRESHOLD, SamplerKind.FACTOR, SamplerKind.ENTROPY)


@dataclass(frozen=True)
class DllmConfig:
    """Diffusion decoding knobs. Defaults follow the anchors (Fast-dLLM τ 0.9, EB γ, DiffusionGemma)."""

    sampler: SamplerKind = SamplerKind.THRESHOLD
    block_size: int | None = None  # canvas length; None: the model's own (DiffusionGemma canvas_length, ...)
    steps: int | None = None  # low-confidence: steps per block; others: a cap per block (None: block size / 48)
    max_new_tokens: int = 128
    temperature: float = 0.0  # mask samplers: 0 = argmax proposals
    threshold: float = 0.9
    factor: float = 1.0
    entropy_bound: float = 0.1
    t_min: float = 0.4  # renoise: temperature anneals t_max -> t_min over the steps
    t_max: float = 0.8
    stability: int = 1  # renoise: stop after the argmax canvas repeated this many steps ...
    confidence: float = 0.005  # ... and the mean entropy is below this
    cache: CacheMode = CacheMode.EXACT
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.block_size is None or self.block_size >= 1, "block size must be >= 1"),
            (self.steps is None or self.steps >= 1, "steps must be >= 1"),
            (self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (0.0 < self.threshold <= 1.0, "threshold must be in (0, 1]"),
            (math.isfinite(self.factor) and self.factor > 0, "factor must be > 0"),
            (math.isfinite(self.entropy_bound) and self.entropy_bound >= 0, "entropy bound must be >= 0"),
            (0 < self.t_min <= self.t_max, "need 0 < t_min <= t_max"),
            (self.stability >= 0 and self.confidence >= 0, "stability and confidence must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidParameterError(msg)
