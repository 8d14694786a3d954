"""The target's logits for one verify forward, computed a few rows at a time as verification reads them.

Why: a verify forward scores N+1 rows (the root and every drafted node), but a walk reads only the rows on
its path, τ of them. The LM head is the largest matrix of a small target (SmolLM2-135M: 28M of 135M weights),
so computing it for every row spends, on a 32-row tree, a sixth of the forward on logits nobody reads (dev/LOG.md,
session 19: head over 32 rows 49 ms, over 4 rows 8 ms, the whole 32-row forward 318 ms on a Zen 1 core).

Policy: the first read computes rows [0, first) — the root and the first nodes, which drafters order best-first
(a chain by depth, DDTree by path probability). A read of a row not yet computed then computes that row's whole
subtree: every row the walk can still reach from there. So a round runs the head at most twice, and a second
pass means the draft was doing well. Values equal a dense computation bit for bit where the head is
row-invariant (byblock's packed fp32 GEMM, the bf16 row-invariant linears: models/), so verification reaches
the same verdicts as with dense logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits

FIRST_ROWS = 4  # root + 3 nodes: one pass of the head streams its weights once, and 4 rows cost ~1 row's time


class TargetRows:
    """Row-indexable target logits [N+1, V] (row 0 = root, row i+1 = node i), filled on first read."""

    def __init__(
        self,
        final: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        children: list[list[int]],
        vocab: int,
        first: int = FIRST_ROWS,
        known: torch.Tensor | None = None,
    ) -> None:
        """final: [N+1, H] the last layer's normed hidden states; head: [k, H] -> [k, V] logits;
        children: Draft.children() of the draft being verified (subtrees say which rows stay reachable);
        known: logits [k, V] of rows 0..k-1 already computed (the batched engine runs the first rows of every
        request's verify in one head pass), k = min(first, N+1)."""
        self._final = final
        self._head = head
        self._children = children
        self._first = max(1, first)
        self._rows: dict[int, torch.Tensor] = {} if known is None else dict(enumerate(known))
        self.shape = (final.shape[0], vocab)
        self.device = final.device
        self.head_calls = 0  # passes of the head (each streams its weights once)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, row: int) -> torch.Tensor:
        """[V] logits of `row`; computes the batch it belongs to on first read."""
        if row not in self._rows:
            batch = range(min(self._first, len(self))) if not self._rows else self._subtree(row)
            self._compute(sorted({row, *batch} - self._rows.keys()))
        return self._rows[row]

    @property
    def computed(self) -> int:
        """Rows the head has run on so far."""
        return len(self._rows)

    def _subtree(self, row: int) -> list[int]:
        """`row` and the rows of all its descendants (row i+1 is node i; children[r] lists row r's nodes)."""
        out, stack = [], [row]
        while stack:
            r = stack.pop()
            out.append(r)
            stack.extend(c + 1 for c in self._children[r])
        return out

    def _compute(self, rows: list[int]) -> None:
        logits = self._head(self._final[rows])  # [k, V]
        self.head_calls += 1
        self._rows.update(zip(rows, logits, strict=True))


class AdjustedRows:
    """A verify forward's target rows [N+1, V] (a tensor or TargetRows), each passed on first read through
    `adjust(logits, path)`, path = the drafted tokens from the root to that row's node (row 0, the root: []).
    How history-dependent processing (penalties, grammar masks) sees, per row, the output plain decoding would
    have at that position."""

    def __init__(
        self,
        rows: torch.Tensor | TargetRows,
        adjust: Callable[[torch.Tensor, list[int]], torch.Tensor],
        tokens: list[int],
        parents: list[int],
    ) -> None:
        """tokens / parents: the draft's node tokens and parent indices (-1 = a child of the root)."""
        self._rows = rows
        self._adjust = adjust
        self._tokens = tokens
        self._parents = parents
        self._done: dict[int, torch.Tensor] = {}
        self.shape = rows.shape
        self.device = rows.device

    def __len__(self) -> int:
        return self.shape[0]

    def path(self, row: int) -> list[int]:
        """The drafted tokens from the root to node row-1, in order."""
        out, node = [], row - 1
        while node >= 0:
            out.append(self._tokens[node])
            node = self._parents[node]
        return out[::-1]

    def __getitem__(self, row: int) -> torch.Tensor:
        """[V] adjusted float32 logits of `row`."""
        if row not in self._done:
            self._done[row] = self._adjust(self._rows[row], self.path(row))
        return self._done[row]


class ProcessedRows:
    """Row-indexable processed target probabilities (temperature, top-k, top-p), each row processed on first
    read: over logits [N+1, V] (a tensor or TargetRows), only the rows a verification reads cost anything."""

    def __init__(self, logits: torch.Tensor | TargetRows, params: SamplingParams) -> None:
        self._logits = logits
        self._params = params
        self._rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, row: int) -> torch.Tensor:
        """[V] float32 probabilities of `row`."""
        if row not in self._rows:
            self._rows[row] = process_logits(self._logits[row], self._params)
        return self._rows[row]
