"""What the machine can do: memory bandwidth (the decode roofline) and a one-line description."""

from __future__ import annotations

import platform
import time

import torch


def measure_read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s for streaming a large float32 tensor from memory (best of `repeats` sums)."""
    x = torch.ones(num_bytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best


def describe_machine() -> str:
    """CPU model, cores, torch version: the header every benchmark result carries."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
