"""Weight-only int4 / int8 linears: the weights stay quantized in memory, converted to float in registers.

A decoding step on a CPU streams every weight once, so bytes per weight set the speed: fp32 is 4 bytes, the
built-in SmolLM2 GGUF 0.6 (Q4_1) and its embedding 1.06 (Q8_0). `csrc/quant_gemm.cpp` keeps groups of 32
inputs per output in one of two layouts (int4: nibbles + a scale and min per group; int8: bytes + a scale; the
values are bitwise the GGUF de-quantizer's; the scales fp16 where they are fp16 values, as a GGUF's Q4_0 / Q4_1 /
Q8_0 hold them, which streams llama.cpp's bytes: Q4_1 20 bytes a group, not the 24 of fp32 scales) and sums
each group factored, s·Σ x q + m·Σ x (the order llama.cpp uses), in fp32 against fp32 activations: equal to
the de-quantized weight's product to fp32 tolerance. Like the packed fp32 GEMM it is row-invariant: each output
is one fixed sequence of FMAs whatever the number of rows, so speculative decoding stays bitwise lossless on it.

Sources of the quantized blocks: a GGUF's own Q4_0 / Q4_1 / Q4_K / Q8_0 tensors (models/gguf_weights.py, exact)
or byblock's round-to-nearest quantizer over float weights (`quantize`, for `--weights int8|int4` from a float
checkpoint).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from byblock.kernels.build import AVX2_FLAGS, load_library
from byblock.kernels.cpu_features import cpu_flags

SCALE_DTYPES = frozenset({torch.float16, torch.float32})
GROUP = 32  # inputs per quantization group (the GGUF block size of Q4_0 / Q4_1 / Q8_0)
PANEL = 16  # outputs per panel (csrc/quant_gemm.cpp)
# De-quantize as multiply-then-add, exactly as the reference does (no FMA contraction).
ISA_FLAGS = {
    "avx2": (*AVX2_FLAGS, "-mf16c", "-ffp-contract=off"),
    "avx512": (*AVX2_FLAGS, "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-ffp-contract=off"),
}
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
# How the activations meet the weights: "int8" quantizes each row per group of 32 and sums in integers
# (csrc/quant_dot.cpp, llama.cpp's recipe; the avx512 build needs VNNI); "fp32" converts the weights to float and
# sums in fp32 (csrc/quant_gemm.cpp; equal to the de-quantized weight's product to fp32 tolerance, slower once
# a call has more than a few rows).
ACTIVATIONS = ("int8", "fp32")
LIBRARY = {"int8": "quant_dot", "fp32": "quant_gemm"}
EXTRA_FLAGS = {"int8": ("-mavx512vnni",), "fp32": ()}  # the avx512 build's
EXTRA_CPU_FLAGS = {"int8": frozenset({"avx512_vnni"}), "fp32": frozenset()}


class QuantGemm:
    """The compiled kernels: y = x W^T (+ b) for int4 or int8 grouped weights, any number of rows."""

    def __init__(self, library: ctypes.CDLL, isa: str, activations: str = "fp32") -> None:
        self._lib = library
        self.isa = isa
        self.activations = activations
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        # The last argument: 1 where scale / minv are fp16 (QuantWeight's compact scales), 0 for fp32.
        library.byblock_int4_linear.argtypes = [vp, i64, i64, vp, vp, vp, i64, vp, vp, i32, i32]
        library.byblock_int4_linear.restype = None
        library.byblock_int8_linear.argtypes = [vp, i64, i64, vp, vp, i64, vp, vp, i32, i32]
        library.byblock_int8_linear.restype = None
        assert library.byblock_quant_group() == GROUP and library.byblock_quant_panel() == PANEL

    def linear(self, x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] fp32 on the CPU -> [..., N]."""
        return self.run(x, w.bits, w.q, w.scale, w.minv, w.out_features, bias)

    def run(
        self,
        x: torch.Tensor,
        bits: int,
        q: torch.Tensor,
        scale: torch.Tensor,
        minv: torch.Tensor | None,
        out_features: int,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """`linear` on the layout's tensors directly (QuantLinear's hot path: no QuantWeight built per call)."""
        if x.device.type != "cpu":  # raw pointers into a CPU kernel
            raise ValueError(f"the quantized GEMM is a CPU kernel; got an input on {x.device}")
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        x2 = x.reshape(rows, k).contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
        if rows:
            b = None if bias is None else bias.data_ptr()
            threads, half = torch.get_num_threads(), int(scale.dtype == torch.float16)
            if bits == 4:
                self._lib.byblock_int4_linear(
                    x2.data_ptr(), rows, k, q.data_ptr(), scale.data_ptr(), minv.data_ptr(), out_features, b,
                    y.data_ptr(), threads, half,
                )  # fmt: skip
            else:
                self._lib.byblock_int8_linear(
                    x2.data_ptr(), rows, k, q.data_ptr(), scale.data_ptr(), out_features, b, y.data_ptr(), threads,
                    half,
                )  # fmt: skip
        return y.view(*x.shape[:-1], out_features)

    def bind(self, w: QuantLinear) -> Callable[[torch.Tensor], torch.Tensor]:
        """`w`'s forward on fp32 CPU inputs as a plain function, for a decoder's hot loop: the same kernel call
        as `run` with the weight's pointers resolved once (the closure keeps its tensors alive), without the
        module machinery. A decode step makes ~120 of these calls, each ~10 µs of Python through `forward`."""
        fn = self._lib.byblock_int4_linear if w.bits == 4 else self._lib.byblock_int8_linear
        n, k, bias, buffers = w.out_features, w.in_features, w.bias, w._buffers
        q, scale = w.q, w.scale
        tensors = (q, scale, w.minv) if w.bits == 4 else (q, scale)  # the kernel's weight arguments
        pointers = tuple(t.data_ptr() for t in tensors)
        b = None if bias is None else bias.data_ptr()
        threads, half = torch.get_num_threads, int(scale.dtype == torch.float16)

        def call(x: torch.Tensor) -> torch.Tensor:
            # The module's path where it differs: autograd, other dtypes, or weights replaced since binding (codes
            # and scales are replaced together, minv with them).
            if x.requires_grad or x.dtype != torch.float32 or buffers["q"] is not q or buffers["scale"] is not scale:
                return w(x)
            rows = x.numel() // k
            x2 = x.reshape(rows, k).contiguous()
            y = torch.empty(rows, n, dtype=torch.float32, device=x.device)
            if rows:
                fn(x2.data_ptr(), rows, k, *pointers, n, b, y.data_ptr(), threads(), half)
            return y.view(*x.shape[:-1], n)

        call.module = w  # the linear it computes (its tensors: what the pointers point into)
        return call

    def quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The int8 kernel's own activation quantization of x [M, K] (for tests): codes, d, d * sum(codes)."""
        if self.activations != "int8":
            raise ValueError("only the int8-activation kernel quantizes its activations")
        x = x.float().contiguous()
        m, k = x.shape
        codes = torch.empty(m, k, dtype=torch.int8, device=x.device)
        d, dsum = torch.empty(m, k // GROUP, device=x.device), torch.empty(m, k // GROUP, device=x.device)
        self._lib.byblock_quantize_activations.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [
            ctypes.c_void_p
        ] * 3
        self._lib.byblock_quantize_activations(x.data_ptr(), m, k, codes.data_ptr(), d.data_ptr(), dsum.data_ptr())
        return codes, d, dsum


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 kernel's activation quantization in torch, op for op (the reference the tests hold it to): per row
    and group of 32, d = max|x| / 127 and codes = round-half-even(x * (1 / d)); returns (codes int8 [M, K], d
    [M, K/32], d * sum(codes) [M, K/32])."""
    m, k = x.shape
    groups = x.float().reshape(m, -1, GROUP)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(groups * inv[..., None]).clamp(-127, 127)
    return codes.to(torch.int8).reshape(m, k), d, d * codes.sum(-1)


def best_isa(activations: str = "fp32") -> str:
    """The widest build of that kernel this CPU runs: "avx512" (16-lane) or "avx2" (8-lane, the portable path)."""
    flags = cpu_flags() or frozenset()
    return "avx512" if flags >= AVX512_CPU_FLAGS | EXTRA_CPU_FLAGS[activations] else "avx2"


@functools.cache
def load_quant_kernel(isa: str | None = None, activations: str = "int8") -> QuantGemm | None:
    """The quantized GEMM for this CPU (or the named build) and activation format, compiled on first use; None
    where it cannot run.

    Lanes are outputs and never mix (and the int8 kernel's sums are exact integers), so a kernel's avx2 and avx512
    builds agree bitwise; every build is row-invariant."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activations {activations!r}; expected one of {list(ACTIVATIONS)}")
    isa = isa or best_isa(activations)
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown ISA {isa!r}; expected one of {sorted(ISA_FLAGS)}")
    flags = ISA_FLAGS[isa] + (EXTRA_FLAGS[activations] if isa == "avx512" else ())
    library = load_library(LIBRARY[activations], flags)
    return None if library is None else QuantGemm(library, isa, activations)


@dataclass(frozen=True)
class QuantWeight:
    """One [N, K] weight in the kernels' layout (K a multiple of 32): outputs in panels of 16, P = ceil(N / 16),
    each group of 32 inputs in chunks of 64 bytes whose byte 4j + b belongs to output j (csrc/quant_gemm.cpp).

    bits 4: q uint8 [P, K/32, 4, 64]: chunk c, byte 4j + b: input 4c + b in the low nibble, 16 + 4c + b in the
            high one; w = scale * q + minv.
    bits 8: q uint8 [P, K/32, 8, 64]: chunk t, byte 4j + b: input 4t + b as int8; w = scale * q.
    scale, minv: [P, K/32, 16] (padded outputs have scale 0), both fp16 where every value is exactly one (a GGUF's
            own Q4_0 / Q4_1 / Q8_0 scales, the round-to-nearest quantizer's), else fp32 (Q4_K's products): 2 bytes
            a group less per output, the same values. Build one with `from_values`."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    minv: torch.Tensor | None
    out_features: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        p, g, w = self.scale.shape
        want = (p, g, 4 if self.bits == 4 else 8, 4 * PANEL)
        if w != PANEL or tuple(self.q.shape) != want or self.q.dtype != torch.uint8:
            raise ValueError(f"q must be uint8 {want}, got {self.q.dtype} {tuple(self.q.shape)}")
        dtypes = {self.scale.dtype} | ({self.minv.dtype} if self.minv is not None else set())
        if (self.minv is None) != (self.bits == 8) or len(dtypes) != 1 or not dtypes <= SCALE_DTYPES:
            raise ValueError("int4 needs a scale and a minv, int8 a scale only, both fp16 or both fp32")
        if not (p - 1) * PANEL < self.out_features <= p * PANEL:
            raise ValueError(f"{p} panels cannot hold {self.out_features} outputs")

    @property
    def in_features(self) -> int:
        return self.scale.shape[1] * GROUP

    @classmethod
    def from_values(
        cls, bits: int, values: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None
    ) -> QuantWeight:
        """From per-output quantized values [N, K] (uint8 0..15 for int4, int8 for int8) and per-group
        scale / minv [N, K/32]: w[n, k] = scale[n, k // 32] * values[n, k] (+ minv[n, k // 32])."""
        n, k = values.shape
        g, p = k // GROUP, -(-n // PANEL)
        pad = p * PANEL - n

        def panels(t: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [P, 16, ...], padded with zeros
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]).reshape(p, PANEL, *t.shape[1:])

        dtype = compact_dtype(scale, minv)
        per_group = lambda t: panels(t.to(dtype)).permute(0, 2, 1).contiguous()  # noqa: E731 [P, G, 16]
        if bits == 4:
            v = panels(values.to(torch.uint8)).reshape(p, PANEL, g, 2, 4, 4)  # [P, j, G, nibble, c, b]
            q = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [P, G, c, j, b]
            return cls(4, q.reshape(p, g, 4, 4 * PANEL).contiguous(), per_group(scale), per_group(minv), n)
        v = panels(values.to(torch.int8).view(torch.uint8)).reshape(p, PANEL, g, 8, 4)  # [P, j, G, t, b]
        q = v.permute(0, 2, 3, 1, 4).reshape(p, g, 8, 4 * PANEL)
        return cls(8, q.contiguous(), per_group(scale), None, n)

    def values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The inverse of `from_values`: (values [N, K], scale [N, K/32], minv [N, K/32] or None)."""
        p, g = self.scale.shape[:2]
        n = self.out_features
        if self.bits == 4:
            chunks = self.q.reshape(p, g, 4, PANEL, 4)  # [P, G, c, j, b]
            v = torch.stack([chunks & 0x0F, chunks >> 4], dim=2)  # [P, G, nibble, c, j, b]
            v = v.permute(0, 4, 1, 2, 3, 5).reshape(p * PANEL, g * GROUP)
        else:
            v = self.q.view(torch.int8).reshape(p, g, 8, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, -1)
        per_output = lambda t: t.float().permute(0, 2, 1).reshape(p * PANEL, g)[:n].contiguous()  # noqa: E731
        return v[:n], per_output(self.scale), None if self.minv is None else per_output(self.minv)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] this layout stands for (s·q + m, bitwise the GGUF de-quantizer's values)."""
        v, scale, minv = self.values()
        groups = v.float().reshape(self.out_features, -1, GROUP) * scale[..., None]
        if minv is not None:
            groups = groups + minv[..., None]
        return groups.reshape(self.out_features, self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """De-quantized output rows `ids` [n] -> fp32 [n, K], bitwise `dequantize()[ids]`, reading only their
        blocks (an embedding lookup from a tied head's blocks)."""
        panel, j = ids // PANEL, ids % PANEL
        g = self.scale.shape[1]
        if self.bits == 4:
            chunks = self.q.reshape(*self.q.shape[:2], 4, PANEL, 4)[panel, :, :, j, :]  # [n, G, c, b]
            v = torch.stack([chunks & 0x0F, chunks >> 4], dim=2)  # [n, G, nibble, c, b]
        else:
            v = self.q.view(torch.int8).reshape(*self.q.shape[:2], 8, PANEL, 4)[panel, :, :, j, :]  # [n, G, t, b]
        groups = v.float().reshape(len(ids), g, GROUP) * self.scale[panel, :, j].float()[..., None]
        if self.minv is not None:
            groups = groups + self.minv[panel, :, j].float()[..., None]
        return groups.reshape(len(ids), g * GROUP)

    def take_rows(self, rows: torch.Tensor) -> QuantWeight:
        """The weight restricted to (or permuted by) these output rows."""
        v, scale, minv = self.values()
        return QuantWeight.from_values(self.bits, v[rows], scale[rows], None if minv is None else minv[rows])

    def nbytes(self) -> int:
        """Bytes held (weights and scales)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.minv) if t is not None)


def compact_dtype(scale: torch.Tensor, minv: torch.Tensor | None) -> torch.dtype:
    """fp16 where every scale (and min) is exactly an fp16 value, else fp32: the layout's scales in the fewest
    bytes that hold them unchanged."""
    for t in (scale, minv):
        if t is not None and not torch.equal(t.float().to(torch.float16).float(), t.float()):
            return torch.float32
    return torch.float16


def _fp16_rounded(t: torch.Tensor) -> torch.Tensor:
    """t rounded to fp16 values (kept fp32) where all of them are normal fp16 numbers or 0 (relative error at most
    2^-11); else t unchanged (the layout then keeps fp32)."""
    half = t.to(torch.float16)
    mag = half.abs()
    fits = bool(torch.isfinite(half).all()) and bool(((mag >= torch.finfo(torch.float16).tiny) | (t == 0)).all())
    return half.float() if fits else t


def quantize(weight: torch.Tensor, bits: int) -> QuantWeight:
    """Round-to-nearest grouped quantization of a float [N, K] weight: int8 symmetric (absmax / 127, as Q8_0),
    int4 asymmetric (min and (max - min) / 15 per group, as Q4_1). Scales and mins are rounded to fp16 first, as
    llama.cpp stores them (fewer bytes per group), the codes computed against the rounded values."""
    n = weight.shape[0]
    w = weight.detach().float().reshape(n, -1, GROUP)  # [N, G, 32]
    if bits == 8:
        scale = _fp16_rounded(w.abs().amax(-1) / 127)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round(w * inv[..., None]).clamp(-128, 127).to(torch.int8)
        return QuantWeight.from_values(8, q.reshape(n, -1), scale, None)
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    lo, hi = w.amin(-1), w.amax(-1)
    scale, lo = _fp16_rounded((hi - lo) / 15), _fp16_rounded(lo)
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantWeight.from_values(4, q.reshape(n, -1), scale, lo)


class QuantLinear(nn.Module):
    """Inference drop-in for nn.Linear with a quantized weight; `.weight` de-quantizes a fresh fp32 copy."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None, kernel: QuantGemm | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.out_features, qweight.in_features
        self.bits = qweight.bits
        self.kernel = kernel
        # Buffers, not parameters: integer tensors cannot be parameters; they still move and count as state.
        self.register_buffer("q", qweight.q)
        self.register_buffer("scale", qweight.scale)
        self.register_buffer("minv", qweight.minv)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)

    @property
    def qweight(self) -> QuantWeight:
        """The weight in the kernel's layout."""
        return QuantWeight(self.bits, self.q, self.scale, self.minv, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] fp32, de-quantized (not for hot loops)."""
        return self.qweight.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        autograd = x.requires_grad and torch.is_grad_enabled()
        if autograd or self.kernel is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return self.kernel.run(x, self.bits, self.q, self.scale, self.minv, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"


def quantize_linears(
    model: nn.Module,
    bits: int,
    kernel: QuantGemm | None,
    skip: set[int] | None = None,
    replaced: Callable[[nn.Linear], None] | None = None,
) -> int:
    """Replace every float nn.Linear whose input size is a multiple of 32 by a QuantLinear (round-to-nearest);
    returns how many were replaced. `skip`: ids of modules to leave alone; `replaced`: called with each module
    once it is out of the model (the loader hands its mapped checkpoint pages back)."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % GROUP == 0 and id(child) not in (skip or set()):
                setattr(parent, name, QuantLinear(quantize(child.weight, bits), child.bias, kernel))
                count += 1
                if replaced is not None:
                    replaced(child)
    return count
