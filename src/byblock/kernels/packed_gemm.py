"""fp32 linears for a few rows at once, near the memory roofline: byblock's own packed-panel GEMM.

A speculative round verifies k tokens in one target forward; it pays only if that forward costs little more
than a plain one-token step. Library fp32 GEMMs on an AVX2 CPU do not: with 2..32 rows they read a weight
and then compute on it, serially, so a 17-token forward of SmolLM2-135M cost 2.3 plain steps (dev/LOG.md,
sessions 10-11). `csrc/packed_gemm.cpp` packs every weight once into 16-column panels, computes up to 6 rows
per panel pass from registers and prefetches the next panel meanwhile; it is also row-invariant (each output
is one FMA chain over k in order, whatever the number of rows), so plain and speculative decoding compute
bit-identical logits for a token.

The C++ source ships with the package and is compiled on first use with the system's g++ into a per-user
cache (one second); without g++, AVX2 or FMA, `load_kernel()` returns None and byblock keeps the library
kernels (`kernels/fast_linear.py`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from byblock.kernels.build import AVX2_FLAGS, load_library
from byblock.kernels.cpu_features import cpu_flags

ALIGN_BYTES = 32  # aligned AVX loads from the packed panels


class PackedGemm:
    """The compiled kernel: pack a weight once, then y = x W^T (+ b) for any number of rows."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        library.byblock_pack.argtypes = [vp, i64, i64, vp]
        library.byblock_pack.restype = None
        library.byblock_packed_linear.argtypes = [vp, i64, i64, vp, i64, vp, vp, ctypes.c_int]
        library.byblock_packed_linear.restype = None
        self.panel = int(library.byblock_panel_width())
        self.isa = "avx512" if library.byblock_packed_isa() == 512 else "avx2"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] fp32 -> packed panels [ceil(N/16) * K * 16], 32-byte aligned."""
        w = weight.detach().to(torch.float32).contiguous()
        n, k = w.shape
        size = -(-n // self.panel) * k * self.panel
        buf = torch.empty(size + ALIGN_BYTES // 4, dtype=torch.float32, device="cpu")  # a CPU kernel's panels
        shift = (-buf.data_ptr() % ALIGN_BYTES) // 4  # torch aligns to 64 bytes; this is a guarantee, not a hope
        packed = buf[shift : shift + size]
        self._lib.byblock_pack(w.data_ptr(), n, k, packed.data_ptr())
        return packed

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [..., K] fp32 on the CPU -> [..., N] with the packed weight (bias [N] or None)."""
        if x.device.type != "cpu":  # raw pointers into a CPU kernel: anything else would read garbage or crash
            raise ValueError(f"the packed GEMM is a CPU kernel; got an input on {x.device}")
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        x2 = x.reshape(rows, k).contiguous()  # a no-op for the usual contiguous activations
        y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
        if rows:
            self._lib.byblock_packed_linear(
                x2.data_ptr(),
                rows,
                k,
                packed.data_ptr(),
                out_features,
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], out_features)


ISA_FLAGS = {"avx2": AVX2_FLAGS, "avx512": (*AVX2_FLAGS, "-mavx512f")}


def best_isa() -> str:
    """The widest build this CPU runs: "avx512" (a 16-lane path for many rows) or "avx2" (the portable one)."""
    return "avx512" if "avx512f" in (cpu_flags() or frozenset()) else "avx2"


@functools.cache
def load_kernel(isa: str | None = None) -> PackedGemm | None:
    """The packed GEMM for this CPU (or the named build), compiled on first use; None where it cannot run
    (reason logged once). Both builds compute every output by the same FMA chain: bitwise equal."""
    isa = isa or best_isa()
    library = load_library("packed_gemm", ISA_FLAGS[isa])
    return None if library is None else PackedGemm(library)


class PackedLinear(nn.Module):
    """Inference drop-in for an fp32 nn.Linear, computed by the packed-panel kernel.

    Keeps only the packed weight; `.weight` unpacks a fresh [out, in] copy on each access (set-up code and
    autograd inputs, e.g. training a drafter through the target's frozen head, take F.linear on it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: PackedGemm) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = kernel
        self.packed = nn.Parameter(kernel.pack(weight), requires_grad=False)  # a parameter: counted, moved
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Module, kernel: PackedGemm) -> PackedLinear:
        """From nn.Linear or any module with `.weight` [out, in] and `.bias`."""
        return cls(linear.weight, getattr(linear, "bias", None), kernel)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] fp32: a fresh unpacked copy (not for hot loops)."""
        panels = self.packed.view(-1, self.in_features, self.kernel.panel)  # [np, K, 16]
        return panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()

    @property
    def weight_t(self) -> torch.Tensor:
        """[in, out] view of `weight`."""
        return self.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        autograd = x.requires_grad and torch.is_grad_enabled()
        if autograd or x.dtype != torch.float32 or self.packed.dtype != torch.float32:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self.kernel.linear(x, self.packed, self.out_features, self.bias)


def pack_linears(model: nn.Module, kernel: PackedGemm, replaced: Callable[[nn.Linear], None] | None = None) -> int:
    """Replace every fp32 nn.Linear in `model` by a PackedLinear; returns how many were replaced. `replaced`: called
    with each module once it is out of the model (the loader hands its mapped checkpoint pages back).

    A tied LM head gets its own packed copy (V*H more floats); the input embedding keeps the [V, H] table."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear.from_linear(child, kernel))
                count += 1
                if replaced is not None:
                    replaced(child)
    return count
