"""Host memory a loaded model no longer needs, handed back: freed heap blocks, and pages of a mapped checkpoint
whose tensors were converted (quantized, re-laid-out) and dropped.

Resident memory is what a user compares with llama.cpp (RESULTS §12); both leaks below are invisible to
Python and torch, and were measured by mapping (/proc/self/smaps, dev/LOG.md session 37).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from collections.abc import Callable
from pathlib import Path

import torch

MADV_DONTNEED = 4  # Linux


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _malloc_trim() -> Callable[[int], int] | None:
    libc = _libc()
    return None if libc is None else getattr(libc, "malloc_trim", None)


def release_freed_memory() -> None:
    """Hand the host memory that set-up work freed (weight conversion, cost probes) back to the OS.

    glibc keeps freed blocks in its heap for reuse, so without this a process stays resident at its set-up peak:
    the batched engine's segment-cost probe alone left ~140 MiB behind (dev/LOG.md, session 37). malloc_trim(0)
    returns every whole free page. A no-op where the C library has none (musl, macOS). Not for hot loops: it
    walks the heap."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _private_file_mapping(address: int) -> bool:
    """Whether `address` lies in a private mapping of a regular file (not the heap, not anonymous memory)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return False
    for line in maps.read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return len(fields) >= 6 and fields[5].startswith("/") and fields[1][3] == "p"
    return False


def drop_mapped_pages(t: torch.Tensor) -> None:
    """Let the OS take back the pages of `t`, a tensor its caller is about to drop, where it is a view of a file
    mapped private (a safetensors checkpoint). Otherwise every page of it that was read stays resident for as
    long as any other tensor keeps the mapping open (the norms, the embedding). Only whole pages inside `t` go;
    `t` must not share its bytes with a live tensor (a tied weight). A no-op for heap or anonymous memory (whose
    pages may be reused by the allocator) and where madvise is missing."""
    libc = _libc()
    if libc is None or t.device.type != "cpu" or not hasattr(libc, "madvise"):
        return
    start = t.data_ptr()
    if not _private_file_mapping(start):
        return
    page = mmap.PAGESIZE
    lo = -(-start // page) * page
    hi = (start + t.numel() * t.element_size()) // page * page
    if hi > lo:
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), MADV_DONTNEED)
