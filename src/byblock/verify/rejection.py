"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a chain drawn from q.

For i = 1..k: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a token
drawn from the residual norm(max(p_i - q_i, 0)) and stop; if all k are accepted emit a bonus token from
p_{k+1}. The emitted tokens are then distributed exactly as if sampled from p one at a time.
"""

from __future__ import annotations

import torch

from byblock.verify.types import Draft, Noise, Verdict


def rejection_chain(draft: Draft, p: torch.Tensor, noise: Noise) -> Verdict:
    """p: [k+1, V] processed target probs; draft.q: [k, V]. Vectorized; equals reference_rejection."""
    assert draft.q is not None and draft.is_chain
    x = draft.tokens  # [k]
    k = x.numel()
    rows = torch.arange(k)
    px = p[rows, x]  # [k]  p_i(x_i)
    qx = draft.q[rows, x]  # [k]  q_i(x_i)
    # u < p/q  <=>  u*q < p  (no division: q(x) > 0 for a sampled x, but be safe with 0/0)
    accepted = noise.u * qx < px  # [k]
    a = int(accepted.long().cumprod(0).sum())
    if a < k:
        residual = (p[a] - draft.q[a]).clamp_min(0)  # [V]
        if float(residual.sum()) <= 0:  # p == q at this row: rejection had probability 0; fall back to p
            residual = p[a]
        last = int((residual / noise.exp_row(a)).argmax())
    else:
        last = int((p[k] / noise.exp_row(k)).argmax())
    return Verdict(path=list(range(a)), tokens=[*x[:a].tolist(), last])
