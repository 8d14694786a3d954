"""LLaDA's low-confidence remasking: a fixed schedule of k tokens per step, the most confident first.

Paper: Nie et al., "Large Language Diffusion Models" (arXiv 2502.09992), Alg. (semi-AR, low_confidence).
"""

from __future__ import annotations

import torch


def transfer_schedule(num_masked: int, steps: int) -> list[int]:
    """Tokens to reveal at each of `steps` steps: num_masked split evenly, the remainder to the first steps."""
    base, extra = divmod(num_masked, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


def select_low_confidence(conf: torch.Tensor, masked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Reveal the k[b] most confident masked positions of each row.

    conf: [B, L] confidence of each position's proposal; masked: [B, L] bool; k: [B] int64.
    Returns [B, L] bool. Ties go to the lower position (stable sort).
    """
    c = conf.masked_fill(~masked, float("-inf"))
    order = torch.sort(c, dim=-1, descending=True, stable=True).indices  # [B, L]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(c.shape[-1], device=c.device).expand_as(order))
    return masked & (rank < k[:, None])


def select_low_confidence_reference(conf: torch.Tensor, masked: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Row by row, position by position: the paper's top-k among masked positions."""
    out = torch.zeros_like(masked)
    for b in range(conf.shape[0]):
        cands = sorted((i for i in range(conf.shape[1]) if masked[b, i]), key=lambda i: (-float(conf[b, i]), i))
        for i in cands[: int(k[b])]:
            out[b, i] = True
    return out
