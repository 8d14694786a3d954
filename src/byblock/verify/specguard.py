"""SpecGuard-style step-level acceptance for reasoning traces: opt-in and NOT lossless.

Lossless verification stops at the first drafted token the target would not have produced. SpecGuard
(arXiv 2604.15244, seed 003) verifies reasoning *steps* instead: a drafted step — tokens up to and including a
step delimiter (a token whose text holds a newline) — is kept whole when the verifier's own signals say the step
is sound, even where it differs from what the target would have written, so one verify forward can keep a whole
line. byblock scores a step with the target's signals from the verify forward it runs anyway:

    log-probability score   mean over the step of log p_target(x_i | prefix) >= min_mean_logprob, and no
                            token below min_token_logprob (one implausible token sinks the step)
    agreement score         the share of the step's tokens that are the target's own top-1 >= min_agreement

Steps are taken in order from the round's root; the first that fails ends the extension. The round keeps the
longer of the lossless acceptance and the guarded steps, then one token of the target's own from the row after
them (its context is exactly the kept tokens). The paper's second signal, an attention-grounding score, needs
attention weights that byblock's fused attention kernels do not return; the agreement score stands in for it.
Chains only (trees and the sampled modes' residual corrections verify losslessly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from byblock.errors import InvalidParameterError
from byblock.verify.types import Draft, Rows, Verdict


@dataclass(frozen=True)
class SpecGuardConfig:
    """Thresholds of the step check (defaults: a step must be one the target finds likely and mostly agrees
    with; 0 / -inf thresholds accept every complete drafted step)."""

    min_mean_logprob: float = -1.0
    min_token_logprob: float = -6.0
    min_agreement: float = 0.6
    delimiter: str = "\n"  # a step ends on a token whose text contains this

    def __post_init__(self) -> None:
        if not (self.min_mean_logprob <= 0 and self.min_token_logprob <= 0):
            raise InvalidParameterError("SpecGuard log-probability thresholds must be <= 0")
        if not 0.0 <= self.min_agreement <= 1.0:
            raise InvalidParameterError("SpecGuard agreement must be in [0, 1]")
        if math.isnan(self.min_mean_logprob) or math.isnan(self.min_token_logprob) or not self.delimiter:
            raise InvalidParameterError("SpecGuard needs real thresholds and a non-empty delimiter")


@lru_cache(maxsize=8)
def _delimiters(tokenizer, delimiter: str) -> frozenset[int]:
    ids = range(len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)
    return frozenset(i for i, t in zip(ids, texts, strict=True) if delimiter in t)


def delimiter_ids(tokenizer, cfg: SpecGuardConfig) -> frozenset[int]:
    """The token ids that end a step (decoded once per tokenizer)."""
    return _delimiters(tokenizer, cfg.delimiter)


def guarded_length(draft: Draft, rows: Rows, accepted: int, ends: frozenset[int], cfg: SpecGuardConfig) -> int:
    """How many of a chain's drafted tokens the step check keeps (>= accepted, the lossless count).

    rows: the (adjusted) target rows; row i scores drafted token i (0-based). Reads rows only past `accepted`."""
    tokens = draft.tokens.tolist()
    start, keep = 0, accepted
    for end, tok in enumerate(tokens, start=1):
        if tok not in ends:
            continue
        if end > accepted:  # a step the lossless rule did not keep whole: score it
            lps, agree = [], 0
            for i in range(start, end):
                row = rows[i].float()
                lp = torch.log_softmax(row, dim=-1)
                lps.append(float(lp[tokens[i]]))
                agree += int(int(row.argmax()) == tokens[i])
            n = end - start
            ok = (
                sum(lps) / n >= cfg.min_mean_logprob
                and min(lps) >= cfg.min_token_logprob
                and agree / n >= cfg.min_agreement
            )
            if not ok:
                break
            keep = end
        start = end
    return keep


def guarded_verdict(draft: Draft, keep: int, bonus: int) -> Verdict:
    """The verdict that keeps the chain's first `keep` drafted tokens, then the target's `bonus` token."""
    return Verdict(path=list(range(keep)), tokens=[*draft.tokens[:keep].tolist(), bonus])
