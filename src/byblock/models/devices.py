"""Where a model runs and in what dtype: `--device auto|cpu|cuda[:N]`, `--dtype auto|float32|bfloat16` and
`--weights auto|fp32|bf16|int8|int4|gguf`, resolved once, before anything is loaded, with one-line errors for
what this machine cannot do."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import torch

from byblock.errors import ByblockError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(text: str | torch.device) -> torch.device:
    """`auto` is CUDA where a GPU is visible, else the CPU; `cuda[:N]` without that GPU is a ByblockError."""
    if isinstance(text, torch.device):
        text = str(text)
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ByblockError(f"unknown device '{text}' (choose from {DEVICE_CHOICES})") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ByblockError(f"unsupported device '{text}' (choose from {DEVICE_CHOICES})")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ByblockError(f"--device {text}: no CUDA device is available (torch {torch.__version__}, {build})")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ByblockError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def resolve_dtype(text: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (its tensor cores' dtype), float32 on the CPU (where byblock's packed fp32 GEMM is
    the fast, row-invariant path; bf16 is only fast on CPUs with native bf16)."""
    if isinstance(text, torch.dtype):
        return text
    if text == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if text not in DTYPES:
        raise ByblockError(f"unknown dtype '{text}' (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[text]


class WeightFormat(enum.Enum):
    """How the linears' weights are stored: as floats (the dtype), or quantized (kernels/quant_gemm.py)."""

    FLOAT = "float"  # the --dtype's floats (fp32: the packed GEMM; bf16: the bf16 kernels)
    INT8 = "int8"  # round-to-nearest per group of 32 (Q8_0-like)
    INT4 = "int4"  # round-to-nearest asymmetric per group of 32 (Q4_1-like)
    GGUF = "gguf"  # the GGUF's own blocks, exactly (models/gguf_weights.py)

    @property
    def quantized(self) -> bool:
        return self is not WeightFormat.FLOAT


WEIGHT_CHOICES = ("auto", "fp32", "bf16", "int8", "int4", "gguf")


def resolve_weights(
    text: str, dtype: torch.dtype, device: torch.device, *, from_gguf: bool, kernel_available: bool
) -> WeightFormat:
    """`auto`: a GGUF's own blocks where the model comes from one and the quantized kernels run here (CPU, fp32
    activations), else floats. fp32 / bf16 name the float formats (`dtype` must agree)."""
    if text not in WEIGHT_CHOICES:
        raise ByblockError(f"unknown weights format '{text}' (choose from {', '.join(WEIGHT_CHOICES)})")
    if text == "auto":
        usable = from_gguf and device.type == "cpu" and dtype == torch.float32 and kernel_available
        return WeightFormat.GGUF if usable else WeightFormat.FLOAT
    if text in ("fp32", "bf16"):
        if dtype != DTYPES[text]:
            raise ByblockError(f"--weights {text} contradicts --dtype {str(dtype).removeprefix('torch.')}")
        return WeightFormat.FLOAT
    fmt = WeightFormat(text)
    if device.type != "cpu":
        raise ByblockError(f"--weights {text}: the quantized kernels are CPU kernels; on {device} use fp32 or bf16")
    if dtype != torch.float32:
        raise ByblockError(f"--weights {text} computes in float32; drop --dtype {str(dtype).removeprefix('torch.')}")
    if fmt is WeightFormat.GGUF and not from_gguf:
        raise ByblockError("--weights gguf needs a GGUF model (a built-in or a .gguf file)")
    return fmt


def weights_dtype(text: str, dtype: str) -> str:
    """The --dtype implied by --weights fp32 / bf16 when --dtype is auto (else --dtype as given)."""
    if dtype == "auto" and text in ("fp32", "bf16"):
        return {"fp32": "float32", "bf16": "bfloat16"}[text]
    return dtype


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU, whose kernels run synchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> Callable[[], float]:
    """A clock for timing work on `device`: perf_counter after the device's queue has drained.

    Asynchronous devices return from a kernel launch before the kernel runs; reading the clock without a sync
    would time the launch, not the work. On the CPU this is plain perf_counter."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock
