"""The target's KV cache: a transformers DynamicCache that byblock can crop and compact.

Every layer is a full (non-sliding) layer even for sliding-window models: the window is applied by the
attention mask instead, so that rolling back a rejected draft never needs tokens a sliding layer dropped.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVCache:
    """Key/value states of every committed token, in order of their slots."""

    def __init__(self) -> None:
        self.hf = DynamicCache()

    @property
    def length(self) -> int:
        """Number of cached slots (tokens)."""
        return self.hf.get_seq_length()

    def crop(self, length: int) -> None:
        """Keep the first `length` slots."""
        for layer in self.hf.layers:
            if layer.is_initialized:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only `slots` (int64 [n], increasing), in that order: compacts a tree's accepted path."""
        for layer in self.hf.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(-2, slots)
                layer.values = layer.values.index_select(-2, slots)

    def commit(self, prefix_len: int, new_slots: torch.Tensor) -> None:
        """Keep slots [0, prefix_len) plus `new_slots` (absolute, increasing, all >= prefix_len).

        A chain's accepted tokens are contiguous, so this is a plain crop; a tree's are not.
        """
        n = int(new_slots.numel())
        if n == 0:
            self.crop(prefix_len)
        elif int(new_slots[-1]) == prefix_len + n - 1:  # contiguous right after the prefix
            self.crop(prefix_len + n)
        else:
            self.keep(torch.cat([torch.arange(prefix_len), new_slots]))
