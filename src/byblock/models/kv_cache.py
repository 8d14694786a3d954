"""The target's KV cache: a transformers DynamicCache that byblock can crop and compact.

Every layer is a full (non-sliding) layer even for sliding-window models: the window is applied by the
attention mask instead, so that rolling back a rejected draft never needs tokens a sliding layer dropped.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVCache:
    """Key/value states of every committed token, in order of their slots."""

    def __init__(self, kv_bits: int | None = None) -> None:
        """kv_bits: None keeps K/V in the model dtype; 8 or 4 stores them quantized (models/kv_quant.py)."""
        self.hf = DynamicCache()
        if kv_bits is not None:
            from functools import partial

            from byblock.models.kv_quant import QuantizedLayer

            self.hf.layer_class_to_replicate = partial(QuantizedLayer, bits=kv_bits)

    @property
    def length(self) -> int:
        """Number of cached slots (tokens)."""
        return self.hf.get_seq_length()

    def crop(self, length: int) -> None:
        """Keep the first `length` slots."""
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            if hasattr(layer, "select"):  # quantized storage
                layer.select(torch.arange(min(length, layer.get_seq_length())))
            else:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only `slots` (int64 [n], increasing), in that order: compacts a tree's accepted path."""
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            if hasattr(layer, "select"):
                layer.select(slots)
            else:
                layer.keys = layer.keys.index_select(-2, slots)
                layer.values = layer.values.index_select(-2, slots)

    def nbytes(self) -> int:
        """Bytes the cached K/V occupy (quantized layers: codes + scales)."""
        total = 0
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            if hasattr(layer, "nbytes"):
                total += layer.nbytes()
            else:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total

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
