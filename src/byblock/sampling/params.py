"""Sampling parameters: one frozen, self-validating dataclass shared by every decoding method."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from byblock.errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen and when generation stops.

    temperature == 0 means greedy (argmax). top_k == 0 and top_p == 1 disable those filters.
    The same processed distribution is used by the target and, where they sample, by drafters —
    speculative sampling is only lossless when p and q are processed identically.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidParameterError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidParameterError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParameterError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidParameterError(f"seed must be a non-negative integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidParameterError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return self.temperature == 0.0
