"""Per-row RMSNorm and rotary embedding in one kernel call each (csrc/row_ops.cpp), with the torch path beside it.

torch's `rms_norm` is a composite of six dispatches on this CPU build and the rotary embedding five more; for
the few rows of a decode step or a drafter block the dispatches are nearly all of the time (dev/LOG.md, session
36). The kernel computes each row on its own in a fixed order (row-invariant, like byblock's GEMMs); its values
are the torch composition's to fp32 rounding, not bitwise (tests/test_row_ops.py holds both to a float64
reference). So it is used only where no bitwise promise to a library forward stands: the drafter's inference
forward (drafters/dflash_packed.py), whose proposals never change what is emitted.

`norm_rope` picks the kernel by capability (fp32, CPU, the library built) and otherwise runs the torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from byblock.kernels.build import AVX2_FLAGS, load_library

FLAGS = (*AVX2_FLAGS, "-ffp-contract=off")


class RowOps:
    """The compiled kernel (see the module docstring)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.byblock_row_norm_rope
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [vp, i64, i64, i64, i64, vp, ctypes.c_int, ctypes.c_float, vp, vp, vp, ctypes.c_int]
        self._fn.restype = None

    def __call__(
        self,
        x: torch.Tensor,
        heads: int,
        weight: torch.Tensor | None,
        eps: float,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [M, heads * K] fp32 on the CPU, last dim contiguous (a column slice of a wider row is fine) ->
        [M, heads, K]: each head RMSNorm-ed with weight [K] (None: not normed) then rotated by cos / sin [M, K]
        (None: not rotated)."""
        m, width = x.shape
        k = width // heads
        if x.stride(-1) != 1 or k % 8 or (cos is not None and k % 2):
            raise ValueError(f"row_ops needs a contiguous last dim and heads of a multiple of 8 floats, got {k}")
        w = None if weight is None else weight.contiguous()
        if cos is not None:
            cos, sin = cos.contiguous(), sin.contiguous()
            if cos.shape != (m, k) or sin.shape != (m, k):
                raise ValueError(f"cos / sin must be [{m}, {k}], got {list(cos.shape)} and {list(sin.shape)}")
        out = torch.empty(m, heads, k, dtype=torch.float32, device=x.device)
        if out.numel():
            self._fn(
                x.data_ptr(), m, heads, k, x.stride(0), None if w is None else w.data_ptr(), int(w is not None),
                float(eps), None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                out.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
        return out


@functools.cache
def load_row_ops() -> RowOps | None:
    """The kernel compiled for this CPU (AVX2 + FMA), or None where it cannot be built."""
    library = load_library("row_ops", FLAGS)
    return None if library is None else RowOps(library)


def _rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The half rotation of heads y [M, heads, K] by cos / sin [M, K]: y cos + (-y[K/2:], y[:K/2]) sin."""
    half = y.shape[-1] // 2
    return y * cos[:, None] + torch.cat([-y[..., half:], y[..., :half]], dim=-1) * sin[:, None]


def torch_norm_rope(
    x: torch.Tensor,
    heads: int,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
) -> torch.Tensor:
    """The same operation in torch ops (any dtype or device): [M, heads * K] -> [M, heads, K]."""
    y = x.reshape(x.shape[0], heads, -1)
    if weight is not None:
        y = torch.rms_norm(y, (y.shape[-1],), weight, eps)
    return y if cos is None else _rotate(y, cos, sin)


def norm_rope(
    x: torch.Tensor,
    heads: int,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, heads * K] -> [M, heads, K], each head RMSNorm-ed (weight None: not) and rotated (cos None: not): the
    kernel where it applies (fp32 on the CPU, K a multiple of 8), else the torch ops."""
    kernel = load_row_ops() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    k = x.shape[-1] // heads
    fits = weight is None or weight.dtype == torch.float32
    if kernel is None or k % 8 or x.stride(-1) != 1 or not fits or (cos is not None and cos.dtype != torch.float32):
        return torch_norm_rope(x, heads, weight, eps, cos, sin)
    return kernel(x, heads, weight, eps, cos, sin)


def reference_norm_rope(
    x: torch.Tensor,
    heads: int,
    weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
) -> torch.Tensor:
    """The definition in float64 (for tests), returned as fp32."""
    y = x.double().reshape(x.shape[0], heads, -1)
    if weight is not None:
        y = weight.double() * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps))
    return (y if cos is None else _rotate(y, cos.double(), sin.double())).float()
