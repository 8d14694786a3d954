"""A KV-cache layer that appends into a preallocated buffer instead of re-concatenating the whole cache.

transformers' DynamicLayer appends with `torch.cat([keys, new], -2)`: every forward copies the layer's whole
cache, so a decode step costs O(context) copies per layer (at 300 cached tokens SmolLM2's 60 cats took ~4 ms of a
~60 ms fp32 step on one core, and more as the context grows). Here K and V live in a buffer [B, H, capacity, D]
that doubles when full; `keys` / `values` are views of its first `length` slots, and an append writes only the
new slots. Attention reads the same numbers in the same order as from a concatenated tensor.

Assigning `keys` / `values` keeps working for the code that compacts a cache by assignment (KVCache.crop/keep,
H2O, SnapKV): a prefix view of the buffer just sets the length (a crop, no copy); any other tensor — always a
fresh one (index_select / gather results) — is copied into the buffer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256  # slots allocated at first use; doubled whenever an append would overflow


def first_moved(slots: torch.Tensor) -> int:
    """The index of the first of `slots` (int64 [n], increasing) that is not its own index (n: none moves)."""
    n = int(slots.numel())
    ident = slots == torch.arange(n, device=slots.device)
    return n if bool(ident.all()) else int(ident.long().argmin())


class _Slots:
    """One of K or V: a growable buffer [B, H, capacity, D] and the number of slots in use."""

    __slots__ = ("buf", "length")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.length = 0

    def view(self) -> torch.Tensor | None:
        """The slots in use, [B, H, length, D] (a view: no copy)."""
        return None if self.buf is None else self.buf[:, :, : self.length]

    # The buffers are normal tensors written under no_grad, whatever mode the caller runs in: forwards run under
    # inference_mode, compactions (StreamingLLM eviction) outside it, and dLLM denoisers with grad enabled. An
    # inference tensor could not be written outside inference_mode nor read by a grad-recording forward.
    @torch.no_grad()
    def reserve(self, like: torch.Tensor, slots: int) -> None:
        """Make room for `slots` slots shaped like `like` [B, H, *, D], keeping the ones in use."""
        b, h, _, d = like.shape
        buf = self.buf
        if buf is not None and buf.shape[0] == b and buf.shape[-2] >= slots and buf.dtype == like.dtype:
            return
        cap = max(MIN_CAPACITY, buf.shape[-2] if buf is not None else 0)
        while cap < slots:  # doubling: appends cost amortised O(1) copies per slot
            cap *= 2
        with torch.inference_mode(False):
            grown = torch.empty(b, h, cap, d, dtype=like.dtype, device=like.device)
        if buf is not None and self.length and buf.shape[0] == b:
            grown[:, :, : self.length] = buf[:, :, : self.length]
        self.buf = grown

    @torch.no_grad()
    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Write `new` [B, H, T, D] after the slots in use; returns the view of all of them."""
        return self.append_inference(new)

    def append_inference(self, new: torch.Tensor) -> torch.Tensor:
        """`append` for callers already under inference_mode or no_grad (forwards): the grad-mode switch costs a
        few microseconds, and a packed forward of 16 requests appends 960 times."""
        t = new.shape[-2]
        buf = self.buf
        if buf is None or buf.shape[0] != new.shape[0] or buf.shape[-2] < self.length + t or buf.dtype != new.dtype:
            with torch.no_grad():
                self.reserve(new, self.length + t)
            buf = self.buf
        assert buf is not None
        buf[:, :, self.length : self.length + t] = new
        self.length += t
        return buf[:, :, : self.length]

    @torch.no_grad()
    def keep(self, slots: torch.Tensor, head: int | None = None) -> None:
        """Keep `slots` (int64 [n], increasing) in order. The slots before the first gap stay where they are;
        only the rest are moved (a tree commit keeps the whole prefix plus a short accepted path). head: the
        index of the first slot that moves, when the caller knows it (`first_moved`)."""
        n = int(slots.numel())
        if head is None:
            head = first_moved(slots)
        if head < n:
            assert self.buf is not None
            tail = self.buf.index_select(2, slots[head:])  # [B, H, n - head, D], a copy: sources may overlap
            self.buf[:, :, head:n] = tail
        self.length = n

    def assign(self, value: torch.Tensor | None) -> None:
        """Replace the slots in use by `value` (a prefix view of the buffer is a crop: no copy)."""
        buf = self.buf
        if value is None or value.dim() != 4:  # transformers' lazy init / reset: nothing in use
            self.length = 0
            if value is None:
                self.buf = None
            return
        if (
            buf is not None
            and value.data_ptr() == buf.data_ptr()
            and value.stride() == buf.stride()
            and value.shape[-2] <= buf.shape[-2]
            and value.shape[:2] == buf.shape[:2]
        ):
            self.length = value.shape[-2]
            return
        if buf is not None and value.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            value = value.clone()  # a view into the buffer (e.g. dropping leading slots): no overlapping copy
        self.length = 0
        self.append(value)


class BufferedLayer(DynamicLayer):
    """DynamicLayer whose `update` writes into a preallocated, doubling buffer (see the module docstring)."""

    def __init__(self) -> None:
        self._k = _Slots()
        self._v = _Slots()
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        """Cached keys [B, Hkv, length, D] (a view of the buffer)."""
        return self._k.view()

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k.assign(value)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        """Cached values [B, Hkv, length, D] (a view of the buffer)."""
        return self._v.view()

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v.assign(value)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new K/V [B, Hkv, T, D]; return all cached K/V (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
            return self._k.append_inference(key_states), self._v.append_inference(value_states)
        return self._k.append(key_states), self._v.append(value_states)

    def select(self, slots: torch.Tensor, head: int | None = None) -> None:
        """Keep only `slots` (int64 [n], increasing), in that order, moving as few slots as possible (the
        slot-selection protocol KVCache.crop/keep use for non-concatenating layers, as QuantizedLayer's).
        head: `first_moved(slots)` if the caller computed it once for all layers."""
        if head is None:
            head = first_moved(slots)
        self._k.keep(slots, head)
        self._v.keep(slots, head)

    def crop_to(self, length: int) -> None:
        """Keep the first `length` slots: no data moves, only the count (KVCache.crop's path, per layer)."""
        self._k.length = min(self._k.length, length)
        self._v.length = min(self._v.length, length)

    def room(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V buffers [B, Hkv, capacity, D], grown to hold `t` more slots (for a kernel that writes the
        new slots itself, kernels/row_attention.py; `advance` then counts them). Needs an initialized layer."""
        for slots in (self._k, self._v):
            assert slots.buf is not None
            if slots.buf.shape[-2] < slots.length + t:
                slots.reserve(slots.buf, slots.length + t)
        assert self._k.buf is not None and self._v.buf is not None
        return self._k.buf, self._v.buf

    def advance(self, t: int) -> None:
        """Count `t` slots written past the end through `room`'s buffers as in use."""
        self._k.length += t
        self._v.length += t

    def get_seq_length(self) -> int:
        """Number of cached slots."""
        return self._k.length if self.is_initialized else 0


def buffered_cache():
    """A transformers DynamicCache whose layers are BufferedLayer (for batched loops outside KVCache)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = BufferedLayer
    return cache
