"""What a drafter proposes (Draft) and what verification decides (Verdict).

A draft is a tree of candidate tokens hanging off the root, which is the last committed token (its K/V
is computed in the same target forward as the draft's). A chain is a tree where node i's parent is i-1.

Worked example (a tree of 4 nodes):
    tokens  = [a, b, c, d]
    parents = [-1, 0, -1, 2]        root ─ a ─ b
                                        └─ c ─ d
    depth   = [1, 2, 1, 2]          node i sits at position  n_committed - 1 + depth[i]
Target logits row 0 scores the root (predicts depth-1 tokens); row i+1 scores node i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Rows(Protocol):
    """Per-row target scores [N+1, ...] (row 0 = root, row i+1 = node i): a tensor, or rows computed when
    first read (verify/rows.py). Verification reads rows one at a time, only those on its path."""

    def __getitem__(self, row: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class Draft:
    """Candidate tokens proposed by a drafter for one verification round."""

    tokens: torch.Tensor  # [N] int64, nodes in topological order (parent index < own index)
    parents: torch.Tensor  # [N] int64, parent node index, -1 for children of the root
    # [N, V] float: the distribution node i's token was sampled from (given its ancestors);
    # None for deterministic drafts (argmax, lookup), which verification treats as point masses.
    q: torch.Tensor | None = None
    is_chain: bool = field(init=False)

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        if self.parents.numel() != n:
            raise ValueError("tokens and parents must have the same length")
        dev = self.parents.device
        if n and bool((self.parents >= torch.arange(n, device=dev)).any()):
            raise ValueError("draft nodes must be in topological order (parent < child)")
        chain = n == 0 or bool(torch.equal(self.parents, torch.arange(-1, n - 1, device=dev)))
        object.__setattr__(self, "is_chain", chain)

    @staticmethod
    def chain(tokens: torch.Tensor | list[int], q: torch.Tensor | None = None) -> Draft:
        """A linear draft: tokens[i] follows tokens[i-1] (a list becomes host metadata, on the CPU)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=tokens.device if torch.is_tensor(tokens) else "cpu")
        if q is not None and q.shape[0] != tokens.numel():
            raise ValueError("q must have one row per drafted token")
        # Parents 0 .. n-2 by construction: a chain, so the topological checks (four tensor ops, a few µs of
        # every round of every request) are skipped.
        draft = object.__new__(Draft)
        parents = torch.arange(-1, tokens.numel() - 1, device=tokens.device)
        for name, value in (("tokens", tokens), ("parents", parents), ("q", q), ("is_chain", True)):
            object.__setattr__(draft, name, value)
        return draft

    @staticmethod
    def tree(tokens: list[int], parents: list[int]) -> Draft:
        """A tree built on the host (lookup tries, best-first trees): host metadata, on the CPU."""
        return Draft(
            tokens=torch.tensor(tokens, dtype=torch.long, device="cpu"),
            parents=torch.tensor(parents, dtype=torch.long, device="cpu"),
        )

    @staticmethod
    def empty() -> Draft:
        """No candidates: the round degenerates to one plain decoding step."""
        return Draft.chain([])

    @property
    def num_nodes(self) -> int:
        """Number of candidate tokens."""
        return int(self.tokens.numel())

    def depths(self) -> torch.Tensor:
        """[N] int64: 1 for children of the root, parent depth + 1 otherwise."""
        if self.is_chain:
            return torch.arange(1, self.num_nodes + 1, device=self.parents.device)
        depth = [0] * self.num_nodes
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return torch.tensor(depth, dtype=torch.long, device=self.parents.device)

    def ancestor_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes): True where row may attend column (itself or an ancestor).

        Built row by row where the parents live (host metadata), then moved to `device` in one copy."""
        n = self.num_nodes
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=self.parents.device)
        mask[0, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            mask[i + 1] = mask[p + 1]  # the parent's row (root when p == -1) ...
            mask[i + 1, i + 1] = True  # ... plus itself
        return mask if device is None else mask.to(device)

    def children(self) -> list[list[int]]:
        """children()[p + 1] lists the node indices whose parent is p (index 0 = the root)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft."""

    path: list[int]  # accepted node indices, root to leaf (len a)
    tokens: list[int]  # tokens to emit: the a accepted draft tokens, then one token of the target's own

    @property
    def num_accepted(self) -> int:
        """a: draft tokens accepted this round (the emitted count is a + 1)."""
        return len(self.path)


@dataclass(frozen=True)
class Noise:
    """All randomness one sampled verification consumes, shared so that fast and reference paths agree.

    Sampling y ~ p is done as argmax(p / e) with e ~ Exp(1) i.i.d. (the exponential-race form of the Gumbel-max
    trick): exact and free of host syncs. The rows of e are not drawn up front: a tree walk only ever samples
    the rows on its path (τ of them, not N+1), and drawing [N+1, V] variates cost a 17-row verify of a
    49k-vocabulary target 18 ms, a third of a plain decoding step. A row is drawn from the round's generator
    the first time anyone asks for it and remembered, so every path handed this Noise sees the same variates
    for a row. (Rows are not keyed by seeding a generator per row: a CPU generator keeps only 32 bits of its
    seed, and row streams would start to collide within long generations.)
    """

    u: torch.Tensor  # [N] uniforms in [0, 1) for accept tests
    vocab: int  # V
    generator: torch.Generator | None
    _rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def draw(num_nodes: int, vocab: int, generator: torch.Generator | None, device: torch.device) -> Noise:
        """Noise for a draft of `num_nodes` nodes over a vocabulary of `vocab` on `device` (the target logits',
        and the generator's when one is given); rows of e follow on demand."""
        u = torch.rand(num_nodes, generator=generator, device=device)
        return Noise(u=u, vocab=vocab, generator=generator)

    def exp_row(self, row: int) -> torch.Tensor:
        """[V] Exp(1) variates for scored position `row` (0 = the root): fresh on first use, then the same."""
        if row not in self._rows:
            row_e = torch.empty(self.vocab, device=self.u.device)
            self._rows[row] = row_e.exponential_(1.0, generator=self.generator)
        return self._rows[row]
