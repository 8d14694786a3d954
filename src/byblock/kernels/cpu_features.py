"""What this CPU does natively, for choosing a dtype.

bf16 is only fast where the CPU has bf16 instructions (AVX512-BF16, AMX-BF16). Elsewhere oneDNN emulates it
and bf16 runs *slower* than fp32: on an AVX2-only AMD EPYC (Zen 3) byblock's batched regeneration did 42
response tok/s in bf16 vs 123 in fp32 (dev/LOG.md, session 10), where an AVX512-BF16 EPYC did 233 vs 131.
"""

from __future__ import annotations

from pathlib import Path

# /proc/cpuinfo flags that give native bf16 matrix math.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's flags in /proc/cpuinfo, or None where that file cannot be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether bf16 GEMMs run natively (and so faster than fp32) on this CPU."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(flags & NATIVE_BF16_FLAGS)
