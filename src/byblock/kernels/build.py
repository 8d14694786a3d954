"""Compiling byblock's C++ kernels on first use: the system's g++ into a per-user cache, loaded with ctypes.

The sources ship with the package (`kernels/csrc/`); each build is keyed by a hash of its source and flags, so
an upgrade recompiles and concurrent processes never load a half-written library. Without g++ or the CPU
features a kernel needs, `load_library` returns None and byblock keeps the library kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from byblock.kernels.cpu_features import cpu_flags

log = logging.getLogger("byblock")

CSRC = Path(__file__).parent / "csrc"
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def cache_dir() -> Path:
    """Where compiled kernels live (honours XDG_CACHE_HOME)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "byblock" / "kernels"


def has_avx2() -> bool:
    """Whether this CPU runs AVX2 + FMA code."""
    flags = cpu_flags()
    if flags is None:
        return torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    return {"avx2", "fma"} <= flags


def _compile(source: Path, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        subprocess.run(["g++", *flags, str(source), "-o", str(so)], check=True, capture_output=True, timeout=120)
        os.replace(so, out)  # atomic: concurrent processes never load a half-written library


def load_library(name: str, flags: tuple[str, ...] = AVX2_FLAGS) -> ctypes.CDLL | None:
    """`csrc/{name}.cpp` compiled for this CPU (cached), or None where it cannot be built (reason logged)."""
    source = CSRC / f"{name}.cpp"
    if not has_avx2() or not source.exists():
        return None
    # The headers in csrc/ too: a source that includes one is rebuilt when it changes.
    headers = b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{digest}.so"
    try:
        if not out.exists():
            if shutil.which("g++") is None:
                log.info("byblock: no g++ found; %s falls back to the library kernels", name)
                return None
            _compile(source, flags, out)
        return ctypes.CDLL(str(out))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("warning: byblock's %s kernel is unavailable (%s); using the library kernels", name, e)
        return None
