"""Sampling parameters: one frozen, self-validating dataclass shared by every decoding method."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from byblock.errors import InvalidParameterError
from byblock.sampling.grammar import Grammar


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are chosen and when generation stops.

    temperature == 0 means greedy (argmax). top_k == 0, top_p == 1 and min_p == 0 disable those filters.
    Penalties (repetition / presence / frequency, vLLM's definitions) and logit_bias adjust the raw logits of
    every target row from that row's own history (sampling/penalties.py), before temperature and filters, so
    greedy decoding follows the penalized argmax. Verification applies them per drafted node, so speculative
    decoding stays lossless with respect to the adjusted distribution whatever the drafter proposes.
    logprobs: None returns none; k >= 0 returns each emitted token's log-probability under the target's raw
    distribution and the k most likely alternatives (vLLM's default `raw_logprobs`).
    stop_token_ids end generation like EOS (even with ignore_eos), the token counted but not shown.
    grammar: structured output — every row masked to the tokens the grammar accepts next (sampling/grammar.py).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    grammar: Grammar | None = None  # structured output: a token mask on every row (sampling/grammar.py)

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
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidParameterError(
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2.0 <= v <= 2.0:
                raise InvalidParameterError(f"{name} must be in [-2, 2], got {v!r}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        object.__setattr__(
            self, "logit_bias", tuple((_token_id(t, "logit_bias"), float(b)) for t, b in self.logit_bias)
        )
        if any(not math.isfinite(b) or not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise InvalidParameterError("logit_bias values must be in [-100, 100]")
        object.__setattr__(self, "stop_token_ids", tuple(_token_id(t, "stop_token_ids") for t in self.stop_token_ids))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidParameterError("grammar must be a byblock.sampling.grammar.Grammar")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidParameterError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is deterministic argmax."""
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """True when penalties or logit_bias change a row's raw logits before sampling."""
        return bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty or self.logit_bias
        )


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs)


def _token_id(t: object, what: str) -> int:
    """A token id from an int or a numeric string (OpenAI's logit_bias keys are strings)."""
    try:
        i = int(t)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise InvalidParameterError(f"{what}: {t!r} is not a token id") from None
    if i < 0 or (isinstance(t, float) and t != i):
        raise InvalidParameterError(f"{what}: {t!r} is not a token id")
    return i
