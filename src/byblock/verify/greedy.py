"""Greedy verification: accept the deepest path whose tokens equal the target's argmax at each step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from byblock.sampling.processors import first_max
from byblock.verify.types import Draft, Rows, Verdict


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


def verify_greedy(draft: Draft, target_logits: Rows) -> Verdict:
    """target_logits: [N+1, V]. Greedy acceptance for chains and trees. Lossless: every emitted token is the
    target's own argmax at its position.

    Dense logits (a tensor) are reduced with one argmax over every row and read back in one `.tolist()`: one
    host sync per round on a GPU. Lazy rows (TargetRows: the CPU path, whose LM head runs only on the rows a
    walk reads) are read row by row, only those on the path."""
    if isinstance(target_logits, torch.Tensor):
        choices = first_max(target_logits).tolist()
        return follow(draft, choices.__getitem__)
    return follow(draft, lambda row: int(first_max(target_logits[row])))
