"""Compute kernels chosen by capability: the packed fp32 GEMM, the int4 / int8 quantized GEMM, row-invariant
bf16, linear layouts, GQA SDPA."""

from __future__ import annotations

import torch
from torch import nn


def invariant_head(head: nn.Module, rows: torch.Tensor | None = None) -> nn.Module | None:
    """`head` (restricted to output `rows`) as a row-invariant fp32 linear on the same kernel — the packed fp32
    GEMM or the quantized one — or None where `head` runs on neither."""
    from byblock.kernels.packed_gemm import PackedLinear
    from byblock.kernels.quant_gemm import QuantLinear

    if isinstance(head, PackedLinear):
        return head if rows is None else PackedLinear(head.weight[rows], None, head.kernel)
    if isinstance(head, QuantLinear):
        return head if rows is None else QuantLinear(head.qweight.take_rows(rows), None, head.kernel)
    return None
