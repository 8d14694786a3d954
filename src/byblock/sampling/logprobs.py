"""Log-probabilities returned with emitted tokens: the target's raw distribution at the row that produced each.

Raw = log_softmax of the model's logits before penalties, temperature and filters (vLLM's default
`raw_logprobs`), so the value does not depend on how a token was sampled. A speculative round's token j comes
from the verify row of its parent (row 0 = the root for the first), the very row plain decoding computes at that
position, so speculative decoding returns the logprobs plain decoding returns (to float32 rounding: a k-row
verify's attention sums in another order than a one-row step's; tests/test_sampling_surface.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token's log-probability and the `top` most likely tokens of its row, best first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """logits: [V] raw logits of the row that produced `token`; k: alternatives to return (0..20)."""
    lp = torch.log_softmax(logits.float(), -1)
    if k == 0:
        return TokenLogprob(float(lp[token]))
    vals, ids = lp.topk(k)
    chosen = float(lp[token])
    return TokenLogprob(chosen, tuple(zip(ids.tolist(), vals.tolist(), strict=True)))
