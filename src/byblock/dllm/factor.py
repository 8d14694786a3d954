"""Fast-dLLM's factor rule: reveal the top-n masked tokens, n the largest with c_(n) >= 1 - f/(n+1).

It applies Fast-dLLM Theorem 1 directly: if n tokens each have marginal > 1 - ε and (n+1)ε <= 1, greedy
decoding of the product of marginals equals greedy decoding of the joint; the factor f scales that ε.
The first token is always revealed.

The public code (NVlabs/Fast-dLLM llada/generate.py, get_transfer_index_dynamic) also reveals the last
candidate when it alone fails its threshold (its `top_i == len(threshs) - 1` branch); byblock follows the
paper's rule, and the test documents that one case.
"""

from __future__ import annotations

import torch


def select_factor(conf: torch.Tensor, masked: torch.Tensor, factor: float) -> torch.Tensor:
    """conf: [B, L]; masked: [B, L] bool. Returns [B, L] bool."""
    c = conf.masked_fill(~masked, float("-inf"))
    sorted_c, order = torch.sort(c, dim=-1, descending=True, stable=True)  # [B, L]
    n = torch.arange(1, c.shape[-1] + 1, dtype=c.dtype, device=c.device)
    thresh = 1.0 - factor / (n + 1.0)
    thresh[0] = float("-inf")  # at least one token per step
    count = torch.cumprod((sorted_c >= thresh).long(), dim=-1).sum(-1)  # [B]: length of the passing prefix
    count = torch.minimum(count, masked.sum(-1))
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(c.shape[-1], device=c.device).expand_as(order))
    return masked & (rank < count[:, None])


def select_factor_reference(conf: torch.Tensor, masked: torch.Tensor, factor: float) -> torch.Tensor:
    """The paper's rule, one row and one candidate at a time."""
    out = torch.zeros_like(masked)
    for b in range(conf.shape[0]):
        cands = sorted((i for i in range(conf.shape[1]) if masked[b, i]), key=lambda i: (-float(conf[b, i]), i))
        for rank, i in enumerate(cands):
            n = rank + 1
            if n > 1 and float(conf[b, i]) < 1.0 - factor / (n + 1):
                break
            out[b, i] = True
    return out
