"""The target's KV cache: a transformers DynamicCache that byblock can crop and compact.

Every layer is a full (non-sliding) layer even for sliding-window models: the window is applied by the
attention mask instead, so that rolling back a rejected draft never needs tokens a sliding layer dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from byblock.kv.block_summary import KeyBlockSummary
from byblock.kv.h2o import H2OState
from byblock.kv.kv_buffer import BufferedLayer, first_moved


@dataclass(frozen=True)
class StreamingWindow:
    """StreamingLLM: every query sees the first `sinks` positions and the `window` most recent ones (itself
    included); everything else is evicted from the cache.

    Applied as a per-query attention mask *and* by eviction between forwards, so a verify block of k tokens
    sees, for each of its queries, exactly what plain decoding would have shown that query: speculative
    decoding stays exactly lossless with respect to the windowed model (tests/test_kv_window.py)."""

    sinks: int = 4
    window: int = 1024

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError("StreamingLLM needs sinks >= 0 and window >= 1")


class KVCache:
    """Key/value states of every committed token, in order of their slots."""

    def __init__(
        self,
        kv_bits: int | None = None,
        window: StreamingWindow | None = None,
        per_head: H2OState | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """kv_bits: None keeps K/V in the model dtype; 8 or 4 stores them quantized (kv/kv_quant.py).
        window: StreamingLLM eviction (None keeps everything). per_head: the per-head slot state of H2O, or of
        SnapKV on sliding-window models (kv/h2o.py). device: the model's, where slot bookkeeping lives."""
        self.hf = DynamicCache()
        self.window = window
        self.h2o = per_head
        self.pos = torch.empty(0, dtype=torch.long, device=device)  # [length] absolute position of each slot
        self.key_summaries: dict[int, KeyBlockSummary] = {}  # per layer, for --sparse-decode (kv/block_summary.py)
        if kv_bits is not None:
            from functools import partial

            from byblock.kv.kv_quant import QuantizedLayer

            self.hf.layer_class_to_replicate = partial(QuantizedLayer, bits=kv_bits)
        else:  # append in place instead of re-concatenating the whole cache every forward (kv/kv_buffer.py)
            self.hf.layer_class_to_replicate = BufferedLayer

    @property
    def length(self) -> int:
        """Number of cached slots (tokens)."""
        return self.hf.get_seq_length()

    @property
    def next_position(self) -> int:
        """The absolute position of the next token (slots and positions differ once tokens are evicted)."""
        return int(self.pos[-1]) + 1 if self.pos.numel() else 0

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one layer's new K/V [B, Hkv, T, D]; returns all of that layer's cached K/V (the packed forward's
        per-request appends, kernels/ragged.py). Straight to the layer: transformers' Cache.update adds a few
        microseconds of bookkeeping per call, and a 16-request forward makes 480 of them."""
        layers = self.hf.layers
        if layer < len(layers):
            return layers[layer].update(key, value)
        return self.hf.update(key, value, layer)

    def record(self, positions: torch.Tensor) -> None:
        """Note the positions [T] of the slots the last forward appended."""
        self.pos = torch.cat([self.pos, positions.to(torch.long)])

    def key_summary(self, layer: int, block_size: int) -> KeyBlockSummary:
        """The per-block key extremes of `layer`, kept current across forwards (attention/sparse_decode.py)."""
        summary = self.key_summaries.get(layer)
        if summary is None or summary.block_size != block_size:
            summary = self.key_summaries[layer] = KeyBlockSummary(block_size)
        return summary

    def evict(self) -> None:
        """Drop every slot the next query can no longer see: StreamingLLM's window, or H2O's choice after the
        last forward's final token (a no-op without either, or when a commit already did it)."""
        if self.h2o is not None and self.h2o.pending:
            self._h2o_commit(len(next(iter(self.h2o.pending.values()))) - 1)
            return
        w = self.window
        if w is None or self.length <= w.sinks + w.window - 1:
            return
        slots = torch.arange(self.length, device=self.pos.device)
        keep = (self.pos < w.sinks) | (slots >= self.length - (w.window - 1))
        self.keep(slots[keep])

    def _h2o_commit(self, node: int) -> None:
        """Make the state H2O reached after the last forward's `node`-th new token the cache's state."""
        st = self.h2o
        assert st is not None
        for i, layer in enumerate(self.hf.layers):
            if not layer.is_initialized:
                continue
            kept = st.pending[i][node]
            idx = kept.slots[None, ..., None].expand(1, -1, -1, layer.keys.shape[-1])  # [1, Hkv, n, D]
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
            st.scores[i], st.pos[i] = kept.scores, kept.pos
        # per-head positions differ; every head keeps its newest slots, so the last one is the same for all
        self.pos = st.pos[0][0]
        self.key_summaries.clear()
        st.pending.clear()

    def crop(self, length: int) -> None:
        """Keep the first `length` slots."""
        if self.h2o is not None:
            raise ValueError("an H2O cache is committed node by node, never cropped")
        if length >= self.pos.shape[0] and length >= self.length:  # nothing past it (a round without a draft)
            return
        self.pos = self.pos[:length]
        for summary in self.key_summaries.values():
            summary.crop(length)
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            if isinstance(layer, BufferedLayer):  # only the slot count changes (no tensor op per layer)
                layer.crop_to(length)
            elif hasattr(layer, "select"):  # quantized storage: a crop is a prefix selection
                layer.select(torch.arange(min(length, layer.get_seq_length()), device=self.pos.device))
            else:
                layer.keys = layer.keys[..., :length, :]
                layer.values = layer.values[..., :length, :]

    def keep(self, slots: torch.Tensor) -> None:
        """Keep only `slots` (int64 [n], increasing), in that order: compacts a tree's accepted path."""
        if self.h2o is not None:
            raise ValueError("an H2O cache is committed node by node, never compacted by slots")
        self.pos = self.pos[slots]
        for summary in self.key_summaries.values():
            summary.keep(slots)
        head = first_moved(slots)  # the same for every layer: computed once, not 30 times
        for layer in self.hf.layers:
            if not layer.is_initialized:
                continue
            if isinstance(layer, BufferedLayer):
                layer.select(slots, head)
            elif hasattr(layer, "select"):  # quantized storage
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

        A chain's accepted tokens are contiguous, so this is a plain crop; a tree's are not. An H2O cache
        instead takes the state its last forward reached at the last kept token (kv/h2o.py).
        """
        n = int(new_slots.numel())
        if self.h2o is not None and self.h2o.pending:
            last = int(new_slots[-1]) if n else prefix_len - 1
            self._h2o_commit(last - self.h2o.pending_past)
            return
        if n == 0:
            self.crop(prefix_len)
        elif int(new_slots[-1]) == prefix_len + n - 1:  # contiguous right after the prefix
            self.crop(prefix_len + n)
        else:
            self.keep(torch.cat([torch.arange(prefix_len, device=self.pos.device), new_slots]))
