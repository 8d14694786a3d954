"""Where a model runs and in what dtype: `--device auto|cpu|cuda[:N]` and `--dtype auto|float32|bfloat16`,
resolved once, before anything is loaded, with one-line errors for what this machine cannot do."""

from __future__ import annotations

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
