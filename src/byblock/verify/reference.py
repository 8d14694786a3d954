"""Slow, paper-notation references for every verification rule. Tests compare the fast paths to these.

Notation: p = target distribution, q = draft distribution, x_i = drafted tokens, γ = draft length.
Randomness comes from a Noise object, so a reference and its fast path see the same draws.
"""

from __future__ import annotations

import torch

from byblock.verify.types import Draft, Noise, Verdict


def _sample(dist: torch.Tensor, e_row: torch.Tensor) -> int:
    """One draw from `dist` (unnormalized is fine) using the exponential race argmax(dist / e)."""
    return int((dist / e_row).argmax())


def reference_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    """Walk from the root; at each node take the target's argmax; follow the child that carries it."""
    path: list[int] = []
    node = -1
    while True:
        row = node + 1
        y = int(target_logits[row].argmax())
        child = None
        for i in range(draft.num_nodes):
            if int(draft.parents[i]) == node and int(draft.tokens[i]) == y:
                child = i
                break
        if child is None:
            return Verdict(path=path, tokens=[int(draft.tokens[i]) for i in path] + [y])
        path.append(child)
        node = child


def reference_tree_sampling(draft: Draft, p: torch.Tensor, noise: Noise) -> Verdict:
    """Sample y ~ p at the current node; move to the child whose token is y, else emit y and stop.

    Lossless for any tree of deterministic candidates: each emitted token is a fresh sample from p given
    the emitted prefix, whatever the candidates were.
    """
    path: list[int] = []
    node = -1
    while True:
        row = node + 1
        y = _sample(p[row], noise.exp_row(row))
        child = next(
            (i for i in range(draft.num_nodes) if int(draft.parents[i]) == node and int(draft.tokens[i]) == y),
            None,
        )
        if child is None:
            return Verdict(path=path, tokens=[int(draft.tokens[i]) for i in path] + [y])
        path.append(child)
        node = child


def reference_rejection(draft: Draft, p: torch.Tensor, noise: Noise) -> Verdict:
    """Leviathan et al. Algorithm 1 for a chain x_1..x_γ drawn from q."""
    assert draft.q is not None
    q = draft.q
    gamma = draft.num_nodes
    emitted: list[int] = []
    for i in range(gamma):
        x_i = int(draft.tokens[i])
        r = float(noise.u[i])
        if r < min(1.0, float(p[i, x_i]) / float(q[i, x_i])) if float(q[i, x_i]) > 0 else r < 1.0:
            emitted.append(x_i)
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0:
            residual = p[i]
        residual = residual / residual.sum()  # norm(max(0, p - q))
        emitted.append(_sample(residual, noise.exp_row(i)))
        return Verdict(path=list(range(i)), tokens=emitted)
    emitted.append(_sample(p[gamma], noise.exp_row(gamma)))  # all accepted: bonus token from p_{γ+1}
    return Verdict(path=list(range(gamma)), tokens=emitted)
