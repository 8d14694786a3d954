"""Fast-dLLM's confidence-threshold parallel decoding: reveal every masked token whose confidence is at
least τ, and always at least the most confident one (so every step makes progress).

Paper: Wu et al., "Fast-dLLM" (arXiv 2505.22618) §3.2; code: NVlabs/Fast-dLLM llada/generate.py
(get_transfer_index with `threshold`).
"""

from __future__ import annotations

import torch


def select_threshold(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """conf: [B, L]; masked: [B, L] bool. Returns [B, L] bool: masked & (conf >= τ), plus each row's argmax."""
    c = conf.masked_fill(~masked, float("-inf"))
    top1 = torch.zeros_like(masked).scatter_(-1, c.argmax(-1, keepdim=True), True) & masked
    return (masked & (conf >= tau)) | top1


def select_threshold_reference(conf: torch.Tensor, masked: torch.Tensor, tau: float) -> torch.Tensor:
    """The paper's loop: sort masked positions by confidence, keep the first, keep the rest if >= τ."""
    out = torch.zeros_like(masked)
    for b in range(conf.shape[0]):
        cands = sorted((i for i in range(conf.shape[1]) if masked[b, i]), key=lambda i: (-float(conf[b, i]), i))
        for rank, i in enumerate(cands):
            if rank == 0 or float(conf[b, i]) >= tau:
                out[b, i] = True
    return out
