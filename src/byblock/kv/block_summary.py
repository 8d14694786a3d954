"""Per-block key extremes kept beside a layer's KV cache: Quest's page metadata, for `--sparse-decode`.

Sparse decode ranks a row's candidate key blocks by the elementwise max and min of each block's keys
(attention/sparse_decode.py). Recomputing those over the whole cache every forward reads every key, which is
what dense attention reads too: on a CPU decode step the sparse path was 3× slower than dense at 4K tokens.
Committed keys never change, so the summary of a full block is computed once, when the block fills, and kept
until the cache drops or rewrites one of its slots (a crop below it, a tree compaction inside it).

Exact by construction: max and min do not depend on how the blocks were grouped into calls, so the kept
extremes equal recomputed ones bit for bit (tests/test_sparse_decode.py).
"""

from __future__ import annotations

import torch


def block_extremes(keys: torch.Tensor, blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., ≥ blocks·b, D] -> (max, min) over each block's keys, [..., blocks, D] each (exact)."""
    *lead, _, d = keys.shape
    tiles = keys[..., : blocks * block_size, :].reshape(*lead, blocks, block_size, d)
    return tiles.amax(-2), tiles.amin(-2)


class KeyBlockSummary:
    """The extremes of one layer's first `valid` full key blocks, extended on demand."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.valid = 0  # leading blocks whose extremes are current
        self.kmax: torch.Tensor | None = None  # [B, Hkv, valid, D]
        self.kmin: torch.Tensor | None = None

    def extremes(self, keys: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys [B, Hkv, L, D] (this layer's whole cache, committed slots first) -> the extremes of its first
        `blocks` blocks, [B, Hkv, blocks, D] each; only blocks not yet summarised are read."""
        bs = self.block_size
        if self.kmax is not None and (self.kmax.shape[:2] != keys.shape[:2] or self.kmax.dtype != keys.dtype):
            self.valid = 0  # another batch shape or dtype: start over
        if blocks > self.valid:
            new_max, new_min = block_extremes(keys[..., self.valid * bs : blocks * bs, :], blocks - self.valid, bs)
            if self.valid and self.kmax is not None and self.kmin is not None:
                new_max = torch.cat([self.kmax[..., : self.valid, :], new_max], dim=-2)
                new_min = torch.cat([self.kmin[..., : self.valid, :], new_min], dim=-2)
            self.kmax, self.kmin, self.valid = new_max, new_min, blocks
        assert self.kmax is not None and self.kmin is not None
        return self.kmax[..., :blocks, :], self.kmin[..., :blocks, :]

    def crop(self, length: int) -> None:
        """The cache kept its first `length` slots: blocks reaching past them are stale."""
        self.valid = min(self.valid, length // self.block_size)

    def keep(self, slots: torch.Tensor) -> None:
        """The cache kept `slots` (increasing) in order: blocks stay current up to the first moved slot."""
        n = int(slots.numel())
        moved = slots != torch.arange(n, device=slots.device)
        first = int(moved.nonzero()[0, 0]) if bool(moved.any()) else n
        self.crop(first)

    def reset(self) -> None:
        """Every slot may have changed (H2O's per-head compaction, an assignment)."""
        self.valid = 0
