"""Entropy-bounded acceptance (EB-Sampler; DiffusionGemma's acceptance rule).

Sort candidate positions by entropy, ascending, and accept the longest prefix U with
Σ_{i∈U} H_i − max_{i∈U} H_i <= γ — an upper bound on the mutual information among the accepted tokens,
so they are approximately independent and may be decoded together. On an ascending prefix the max is its
last element, so the test is cumsum(H) − H <= γ, and the lowest-entropy token is always accepted.

Paper: Ben-Hamu et al., "Accelerated Sampling from Masked Diffusion Models via Entropy Bounded Unmasking"
(arXiv 2505.24857); DiffusionGemma: transformers generation_diffusion_gemma.py (EntropyBoundSampler).
"""

from __future__ import annotations

import torch


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) on the last dim, computed as torch.distributions.Categorical does
    (normalised logits clamped at the dtype's min times probabilities), so acceptance decisions are
    bit-identical to transformers' DiffusionGemma."""
    logp = logits - logits.logsumexp(-1, keepdim=True)
    logp = logp.clamp(min=torch.finfo(logp.dtype).min)
    return -(logp * torch.softmax(logits, -1)).sum(-1)


def select_entropy_bound(ent: torch.Tensor, eligible: torch.Tensor, gamma: float) -> torch.Tensor:
    """ent: [B, L]; eligible: [B, L] bool (mask samplers: masked positions; renoise: all). Returns [B, L] bool."""
    h = ent.masked_fill(~eligible, float("inf"))
    s, idx = torch.sort(h, dim=-1)
    keep = (torch.cumsum(s, -1) - s) <= gamma  # inf - inf = nan compares False: ineligible never kept
    return torch.zeros_like(eligible).scatter(-1, idx, keep) & eligible


def select_entropy_bound_reference(ent: torch.Tensor, eligible: torch.Tensor, gamma: float) -> torch.Tensor:
    """The paper's definition checked set by set: grow U in ascending entropy order while Σ H − max H <= γ."""
    out = torch.zeros_like(eligible)
    for b in range(ent.shape[0]):
        cands = sorted((i for i in range(ent.shape[1]) if eligible[b, i]), key=lambda i: (float(ent[b, i]), i))
        chosen: list[float] = []
        for i in cands:
            trial = [*chosen, float(ent[b, i])]
            if chosen and sum(trial) - max(trial) > gamma:
                break
            chosen = trial
            out[b, i] = True
    return out
