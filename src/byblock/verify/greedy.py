"""Greedy verification: accept the deepest path whose tokens equal the target's argmax at each step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from byblock.verify.types import Draft, Verdict


def follow(draft: Draft, choose: Callable[[int], int]) -> Verdict:
    """From the root, take the target's token choose(row) at each node and move to the child carrying it; stop
    where none does. choose is asked only for the rows on the path (row 0 = root, row i+1 = node i)."""
    kids = draft.children()
    tokens = draft.tokens.tolist()
    path: list[int] = []
    row = 0  # row of the current node in the target logits (0 = root)
    while True:
        y = choose(row)
        nxt = next((c for c in kids[row] if tokens[c] == y), None)
        if nxt is None:
            return Verdict(path=path, tokens=[tokens[i] for i in path] + [y])
        path.append(nxt)
        row = nxt + 1


def walk(draft: Draft, choice: torch.Tensor) -> Verdict:
    """Follow the child whose token equals the target's choice at each node; stop where none does.

    choice: [N+1] int64, the target's token at the root (row 0) and after each node (row i+1), e.g. its argmax.
    Lossless: every emitted token is the target's own choice at its position.
    """
    if draft.is_chain:  # fast path: the matching prefix is a cumulative product
        n = draft.num_nodes
        a = int((draft.tokens == choice[:n]).long().cumprod(0).sum()) if n else 0
        return Verdict(path=list(range(a)), tokens=[*draft.tokens[:a].tolist(), int(choice[a])])
    return follow(draft, choice.tolist().__getitem__)


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    """target_logits: [N+1, V]. Greedy acceptance for chains and trees."""
    return walk(draft, target_logits.argmax(-1))
