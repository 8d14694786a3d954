"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a chain drawn from q.

For i = 1..k: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a token
drawn from the residual norm(max(p_i - q_i, 0)) and stop; if all k are accepted emit a bonus token from
p_{k+1}. The emitted tokens are then distributed exactly as if sampled from p one at a time.
"""

from __future__ import annotations

from byblock.verify.types import Draft, Noise, Rows, Verdict


def rejection_chain(draft: Draft, p: Rows, noise: Noise) -> Verdict:
    """p: processed target probs, row-indexable [k+1, V] (a tensor, or rows computed on first read);
    draft.q: [k, V]. Reads only rows 0..a (a = accepted); equals reference_rejection."""
    assert draft.q is not None and draft.is_chain
    x = draft.tokens.tolist()  # [k]
    k = len(x)
    u = noise.u.tolist()  # [k]
    a = 0
    # u < p/q  <=>  u*q < p  (no division: q(x) > 0 for a sampled x, but be safe with 0/0)
    while a < k and u[a] * float(draft.q[a, x[a]]) < float(p[a][x[a]]):
        a += 1
    if a < k:
        residual = (p[a] - draft.q[a]).clamp_min(0)  # [V]
        if float(residual.sum()) <= 0:  # p == q at this row: rejection had probability 0; fall back to p
            residual = p[a]
        last = int((residual / noise.exp_row(a)).argmax())
    else:
        last = int((p[k] / noise.exp_row(k)).argmax())
    return Verdict(path=list(range(a)), tokens=[*x[:a], last])
