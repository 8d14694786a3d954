"""Records the engine emits: one per token while streaming, one summary per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from byblock.sampling.logprobs import TokenLogprob


class FinishReason(StrEnum):
    """Why generation ended (OpenAI's vocabulary)."""

    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_new_tokens or the context window


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One token leaving the decoding loop."""

    token_id: int
    from_draft: bool  # True: drafted and accepted; False: produced by the target itself
    logprob: TokenLogprob | None = None  # when the request asked for logprobs


@dataclass
class SpecStats:
    """Per-request speculative decoding counters (a plain decode is a run of rounds with no draft)."""

    rounds: int = 0
    drafted_nodes: int = 0
    emitted_by_rounds: int = 0  # accepted + 1 per round (τ's numerator)
    accept_counts: list[int] = field(default_factory=list)  # accept_counts[a] = rounds that accepted a
    position_drafted: list[int] = field(default_factory=list)  # rounds whose draft reached depth d+1
    position_accepted: list[int] = field(default_factory=list)  # rounds that accepted depth d+1
    draft_s: float = 0.0
    verify_s: float = 0.0
    guard_tokens: int = 0  # SpecGuard: drafted tokens kept by the (lossy) step check beyond lossless acceptance

    def record(self, draft_depth: int, num_nodes: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Add one verification round."""
        self.rounds += 1
        self.drafted_nodes += num_nodes
        self.emitted_by_rounds += accepted + 1
        for lst, n in ((self.accept_counts, accepted + 1), (self.position_drafted, draft_depth)):
            lst.extend([0] * (n - len(lst)))
        self.accept_counts[accepted] += 1
        self.position_accepted.extend([0] * (draft_depth - len(self.position_accepted)))
        for d in range(draft_depth):
            self.position_drafted[d] += 1
        for d in range(accepted):
            self.position_accepted[d] += 1
        self.draft_s += draft_s
        self.verify_s += verify_s

    @property
    def mean_accepted(self) -> float:
        """τ: tokens emitted per verification round, the target's own token included."""
        return self.emitted_by_rounds / self.rounds if self.rounds else 0.0

    def per_position_acceptance(self) -> list[float]:
        """P(depth d accepted | the draft reached depth d), d = 1..max."""
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted, strict=False)]


@dataclass(frozen=True)
class StreamEvent:
    """A text delta for the consumer, with the tokens behind it."""

    text: str
    tokens: tuple[TokenEvent, ...]
    elapsed_s: float  # since the request started


@dataclass(frozen=True)
class GenerationResult:
    """Everything one request produced."""

    text: str
    token_ids: list[int]
    from_draft: list[bool]
    prompt_tokens: int
    finish_reason: FinishReason
    ttft_s: float
    total_s: float
    drafter: str
    block_size: int  # tokens per verify forward, the anchor included (--block-size); 1 for plain decoding
    stats: SpecStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them

    @property
    def num_new_tokens(self) -> int:
        """Number of generated tokens (EOS included when it ended the request)."""
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput after the first token (the first token's time is TTFT)."""
        dt = self.total_s - self.ttft_s
        return (self.num_new_tokens - 1) / dt if self.num_new_tokens > 1 and dt > 0 else 0.0

    def to_json(self) -> dict:
        """The `--json` object."""
        s = self.stats
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "num_new_tokens": self.num_new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason.value,
            "ttft_s": round(self.ttft_s, 6),
            "total_s": round(self.total_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "drafter": self.drafter,
            "block_size": self.block_size,
            "num_speculative_tokens": self.block_size - 1,  # drafted per round at most (vLLM's count)
            "rounds": s.rounds,
            "mean_accepted": round(s.mean_accepted, 4),
            "acceptance_histogram": s.accept_counts,
            "per_position_acceptance": [round(x, 4) for x in s.per_position_acceptance()],
            "num_draft_accepted": sum(self.from_draft),
            "draft_s": round(s.draft_s, 6),
            "verify_s": round(s.verify_s, 6),
            **({"lossy_guard_tokens": s.guard_tokens} if s.guard_tokens else {}),
            **({"logprobs": [_logprob_json(lp) for lp in self.logprobs]} if self.logprobs is not None else {}),
        }


def _logprob_json(lp: TokenLogprob | None) -> dict | None:
    """A token's logprob and its alternatives for --json (ids, not strings: the caller has the tokenizer)."""
    if lp is None:
        return None
    return {"logprob": round(lp.logprob, 6), "top": [[i, round(v, 6)] for i, v in lp.top]}
