"""Linears side by side as one call, and quantized linears as bound functions, for hand-written forwards.

Used by the target's decoder forward (models/decoder.py) and the drafter's inference forward
(drafters/dflash_packed.py). Fusing is exact for byblock's kernels: each output is computed on its own (row- and
column-invariant), so a fused call gives every output bitwise what the separate calls give; the fused weights are
views shared with the original modules, not copies. Where the parts already lie side by side in one storage (the
GGUF cache stores the groups of SIDE_BY_SIDE that way, models/gguf_weights.py) the fused weight is a view of it and
nothing is copied at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from byblock.kernels.packed_gemm import PackedLinear
from byblock.kernels.quant_gemm import PANEL, QuantLinear, QuantWeight

# Sibling linears the decoder forwards call as one (models/decoder.py): stored side by side where byblock lays
# weights out itself, so fusing them copies nothing.
SIDE_BY_SIDE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _side_by_side(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors' concatenation along dim 0 as a view, where they are contiguous consecutive slices of one
    storage; else None."""
    first = parts[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    for t in parts:
        same = t.untyped_storage().data_ptr() == storage.data_ptr() and t.storage_offset() == offset
        if not (same and t.is_contiguous()):
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in parts), *first.shape[1:])
    return first.new_empty(0).set_(storage, first.storage_offset(), shape, first.stride())


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenation along dim 0: a view where the parts lie side by side already, else a copy."""
    view = _side_by_side(parts)
    return torch.cat(parts) if view is None else view


def fuse_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One linear computing `linears`' outputs side by side, sharing their storage; None where they are not all
    byblock kernels of one kind with panel-aligned sizes (then the caller keeps calling them one by one)."""
    if any(getattr(m, "bias", None) is not None for m in linears):
        return None
    if all(isinstance(m, QuantLinear) for m in linears):
        first = linears[0]
        if len({m.bits for m in linears}) != 1 or any(m.out_features % PANEL for m in linears[:-1]):
            return None
        parts = [m.qweight for m in linears]
        minv = None if first.bits == 8 else _cat([p.minv for p in parts])
        fused = QuantWeight(
            first.bits,
            _cat([p.q for p in parts]),
            _cat([p.scale for p in parts]),
            minv,
            sum(m.out_features for m in linears),
        )
        start = 0
        for m in linears:  # the separate modules become views of the fused storage: no second copy
            panels = slice(start, start + m.q.shape[0])
            m.q, m.scale = fused.q[panels], fused.scale[panels]
            if minv is not None:
                m.minv = fused.minv[panels]
            start += m.q.shape[0]
        return QuantLinear(fused, None, first.kernel)
    if all(isinstance(m, PackedLinear) for m in linears):
        first = linears[0]
        if any(m.in_features != first.in_features or m.out_features % PANEL for m in linears[:-1]):
            return None
        fused = PackedLinear.__new__(PackedLinear)
        nn.Module.__init__(fused)
        fused.out_features = sum(m.out_features for m in linears)
        fused.in_features, fused.kernel, fused.bias = first.in_features, first.kernel, None
        fused.packed = nn.Parameter(torch.cat([m.packed.data for m in linears]), requires_grad=False)
        start = 0
        for m in linears:
            n = m.packed.numel()
            m.packed = nn.Parameter(fused.packed.data[start : start + n], requires_grad=False)
            start += n
        return fused
    return None


def bound(m: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`m` as the decoder calls it: a quantized linear on its kernel as a bound function (QuantGemm.bind, ~10 µs
    less Python per call, the same kernel call), anything else (None included) as it is."""
    if isinstance(m, QuantLinear) and m.kernel is not None:
        return m.kernel.bind(m)
    return m
