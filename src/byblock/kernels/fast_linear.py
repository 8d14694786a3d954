"""A weight layout that CPU GEMV kernels stream faster.

Measured on this project's CPU (dev/LOG.md): for one token (M = 1), `x @ W_t` with W_t stored
[in, out] row-major streams weights at ~19 GB/s, while `F.linear(x, W)` with the usual [out, in] layout
reaches ~11 GB/s. Decode is weight-streaming bound, so every nn.Linear of the target is re-laid out once
at load time. The math is the same product; only float summation order may differ in the last bits.
"""

from __future__ import annotations

import torch
from torch import nn


class InOutLinear(nn.Module):
    """y = x @ W_t (+ b) with W_t: [in, out] contiguous. Drop-in for nn.Linear in inference."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] view, for code that reads `.weight` (shape checks, tied-weight lookups)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class DualLayoutLinear(nn.Module):
    """Both layouts of one weight; the row count of the input picks the faster kernel.

    Measured here (dev/LOG.md): fp32 is fastest [in, out] for one row but [out, in] (F.linear) for 8+ rows;
    bf16 is the reverse (F.linear for one row, 3-5x faster [in, out] GEMMs for 8+ rows). A verify forward
    has k rows, a plain step one: each gets its best kernel for twice the weight memory.
    """

    def __init__(self, linear: nn.Module, min_rows: int, rows_use_t: bool) -> None:
        super().__init__()
        w = linear.weight.detach()  # [out, in]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.w = nn.Parameter(w.contiguous(), requires_grad=False)
        self.w_t = nn.Parameter(w.t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.min_rows = min_rows  # inputs with at least this many rows ...
        self.rows_use_t = rows_use_t  # ... use x @ W_t when True (else F.linear), fewer rows the other kernel

    @property
    def weight(self) -> torch.Tensor:
        """[out, in], for code that reads `.weight`."""
        return self.w

    @property
    def weight_t(self) -> torch.Tensor:
        """[in, out]."""
        return self.w_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        many = x.numel() >= self.min_rows * self.in_features
        y = x @ self.w_t if many == self.rows_use_t else torch.nn.functional.linear(x, self.w)
        return y if self.bias is None else y + self.bias


def dual_layout_linears(model: nn.Module, min_rows: int = 4) -> int:
    """Replace every nn.Linear by a DualLayoutLinear whose kernel choice suits the model's dtype."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                rows_use_t = child.weight.dtype == torch.bfloat16
                setattr(parent, name, DualLayoutLinear(child, min_rows, rows_use_t))
                count += 1
    return count


def relayout_linears(model: nn.Module, include_lm_head: bool = True) -> int:
    """Replace every nn.Linear in `model` by an InOutLinear; returns how many were replaced.

    The LM head is usually tied to the input embedding ([V, H], needed row-wise for lookups); re-laying it
    out makes a transposed copy (V*H more parameters in memory) — worth it, it is the largest matrix.
    """
    count = 0
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and (include_lm_head or child is not lm_head):
                setattr(parent, name, InOutLinear(child))
                count += 1
    return count
