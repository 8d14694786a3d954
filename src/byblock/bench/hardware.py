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


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters streamed per decode step.

    Tied tensors count once. An input embedding that is not also the LM head is only row-gathered, so
    it does not count (byblock's re-laid-out LM head is such a separate copy).
    """
    emb = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ptr = head.weight.data_ptr() if head is not None else None
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if emb is not None and p.data_ptr() == emb.data_ptr() and p.data_ptr() != head_ptr:
            continue
        total += p.numel() * p.element_size()
    return total
