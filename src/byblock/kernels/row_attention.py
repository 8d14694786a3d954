"""Row-local attention for decode and verify forwards on the CPU (csrc/row_attention.cpp).

Each (sequence, head, query row) is computed over exactly its visible keys, in slot order, with every reduction
in an order fixed by those keys alone: a token decoded alone, verified in a chain of k or in a tree gets the
same bits. Torch's SDPA does not give that (it blocks rows and keys by the call's shape and sums masked keys as
zeros); with int8 activations the ~1e-7 differences it leaves are amplified by the activations' rounding into
different tokens (dev/LOG.md, session 28). `row_attention` is the kernel, `reference_attention` the float64
definition the tests hold it to, and `visible_rows` turns a caller's mask into the kernel's key sets (or says it
cannot: then the caller keeps SDPA); `key_sets` does that once per mask, not once per layer.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from byblock.kernels.build import AVX2_FLAGS, load_library
from byblock.kernels.cpu_features import cpu_flags

FLAGS = (*AVX2_FLAGS, "-ffp-contract=off")
# The avx512 build does the AVX2 build's per-lane arithmetic in 16-lane registers: the same bits, half the
# instructions (csrc/row_attention.cpp), so the choice is by capability alone.
ISA_FLAGS = {"avx2": FLAGS, "avx512": (*FLAGS, "-mavx512f")}


class RowAttention:
    """The compiled kernel (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.byblock_row_attention
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [vp, *[i64] * 7, vp, vp, *[i64] * 8, vp, i64, i64, ctypes.c_float, vp, ctypes.c_int]
        self._fn.restype = None
        self._packed = library.byblock_packed_row_attention
        self._packed.argtypes = [vp, i64, i64, i64, i64, vp, i64, i64, vp, i64, i64, i64, vp, i64, ctypes.c_float]
        self._packed.argtypes += [vp, ctypes.c_int]
        self._packed.restype = None

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        visible: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """query [B, H, T, D], key / value [B, Hkv, S, D] fp32 on the CPU (last dim contiguous), visible None
        (causal: row t sees keys 0 .. S - T + t), bool / uint8 [B|1, T, S], or [B|1, Hkv, T, S] (a key set per
        KV head, shared by the query heads it serves) -> [B, T, H, D] contiguous."""
        b, h, t, d = query.shape
        hkv, s = key.shape[1], key.shape[2]
        if h % hkv:
            raise ValueError(f"{h} query heads do not group over {hkv} key/value heads")
        if visible is None and s < t:
            raise ValueError("causal rows need at least as many keys as queries")
        query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
        mask = None if visible is None else visible.to(torch.uint8).contiguous()
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]
        if mask is not None and (
            mask.dim() != 4 or mask.shape[2:] != (t, s) or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hkv)
        ):
            raise ValueError(f"visible must be [1|{b}, {t}, {s}] or [1|{b}, 1|{hkv}, {t}, {s}], got {list(mask.shape)}")
        out = torch.empty(b, t, h, d, dtype=torch.float32, device=query.device)  # never the default device
        if out.numel():
            self._fn(
                query.data_ptr(), b, h, t, d, query.stride(0), query.stride(1), query.stride(2),
                key.data_ptr(), value.data_ptr(), hkv, s, key.stride(0), key.stride(1), key.stride(2),
                value.stride(0), value.stride(1), value.stride(2),
                None if mask is None else mask.data_ptr(), 1 if mask is None else mask.shape[0],
                1 if mask is None else mask.shape[1],
                float(scale), out.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return out

    def packed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        table: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Several segments of a packed forward in one call: query [1, H, R, D], key / value [1, Hkv, R, D] (the
        new rows), table int64 [n, SEGMENT_FIELDS] contiguous, one row per segment (csrc/row_attention.cpp: its
        rows, past slots, cache buffers' pointers and strides, key-set mask pointer or 0 and its head count).
        Writes each segment's new K/V into its buffers and its rows of out [R, H, D], the bits `__call__` gives
        the segment alone."""
        query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
        if table.shape[-1] != SEGMENT_FIELDS or not table.is_contiguous():
            raise ValueError(f"the segment table must be contiguous [n, {SEGMENT_FIELDS}]")
        self._packed(
            query.data_ptr(), query.shape[1], query.shape[3], query.stride(1), query.stride(2),
            key.data_ptr(), key.stride(1), key.stride(2), value.data_ptr(), value.stride(1), value.stride(2),
            key.shape[1], table.data_ptr(), table.shape[0], float(scale), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip


SEGMENT_FIELDS = 11  # csrc/row_attention.cpp's SEG_FIELDS


@functools.cache
def load_row_attention(isa: str | None = None) -> RowAttention | None:
    """The kernel compiled for this CPU (AVX-512 where it has it, else AVX2 + FMA) or for the named build, or None
    where it cannot be built. Both builds give the same bits (tests/test_row_attention.py)."""
    if isa is None:  # the widest build this CPU runs; the AVX2 one where the AVX-512 build does not compile
        wide = load_row_attention("avx512") if "avx512f" in (cpu_flags() or ()) else None
        return wide or load_row_attention("avx2")
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA {isa!r}; expected one of {sorted(ISA_FLAGS)}")
    library = load_library("row_attention", ISA_FLAGS[isa])
    return None if library is None else RowAttention(library)


def visible_rows(mask: torch.Tensor | None, t: int, s: int) -> torch.Tensor | bool | None:
    """The key sets of a caller's attention mask as the kernel takes them: None (causal rows, or one row seeing
    every key), a bool [B|1, T, S] tensor, or False where the mask is not a pure visibility mask (per-head masks,
    or an additive mask with values other than 0 and the dtype's minimum: biases the kernel does not apply)."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (t, s):
        return False
    rows = mask[:, 0]
    if rows.dtype == torch.bool:
        return rows
    if not rows.is_floating_point():
        return False
    seen = rows == 0
    if not bool((seen | (rows <= torch.finfo(rows.dtype).min / 2)).all()):
        return False
    return seen


class _KeySetMemo:
    """`visible_rows` of each live mask, computed once: a forward passes one mask object to all its layers (per
    layer type, per packed segment), and converting it — a scan of the whole [T, S] mask — cost every layer
    again. Entries die with their mask (a weak reference), so nothing outlives the forward that built it."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, int, torch.Tensor | bool | None]] = {}

    def __call__(self, mask: torch.Tensor | None, t: int, s: int) -> torch.Tensor | bool | None:
        if mask is None:
            return None
        key = id(mask)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is mask and entry[1:3] == (t, s):
            return entry[3]
        rows = visible_rows(mask, t, s)
        if isinstance(rows, torch.Tensor):
            rows = rows.to(torch.uint8).contiguous()  # the kernel's own form: no conversion per call either
        self._entries[key] = (weakref.ref(mask, lambda _, k=key: self._entries.pop(k, None)), t, s, rows)
        return rows


# key_sets(mask, t, s) -> visible_rows(mask, t, s), as uint8, computed once per mask object. Masks are built
# per forward and never written after (models/adapter.py, transformers' masking_utils).
key_sets = _KeySetMemo()


def reference_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The kernel's definition in float64 (for tests): same shapes and meaning as RowAttention.__call__."""
    h, t = query.shape[1], query.shape[2]
    s = key.shape[2]
    group = h // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    if visible is None:
        visible = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(diagonal=s - t)[None]
    scores = (query.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).float().contiguous()
