"""A/B of byblock's packed fp32 GEMM: the kernel source at a git revision vs the working tree's, same process.

This machine's speed drifts by ±20 % within minutes, so the two builds run interleaved (round-robin, medians)
on the same packed weights: (1) one linear streamed from memory — 60 distinct copies of a SmolLM2 layer shape
(so every call reads DRAM, as in a forward) and the LM head — µs per call by row count; (2) whole SmolLM2-135M
forwards over k new tokens after a 90-token prompt, with both builds swapped into the same loaded model, total
ms and ms inside the linears. Both builds must give bit-identical outputs (asserted).

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/packed_gemm_ab.py --base-rev 2377824
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from byblock.kernels.build import AVX2_FLAGS as FLAGS
from byblock.kernels.build import CSRC
from byblock.kernels.packed_gemm import PackedGemm, PackedLinear
from byblock.models.loading import load_model

SOURCE = CSRC / "packed_gemm.cpp"

ROWS = (1, 2, 3, 4, 6, 8, 9, 12, 17, 32)
FORWARD_K = (1, 2, 3, 5, 9, 17, 32)


def build(source_text: str, out: Path) -> PackedGemm:
    """Compile one kernel source with byblock's flags and load it."""
    src = out.with_suffix(".cpp")
    src.write_text(source_text)
    subprocess.run(["g++", *FLAGS, str(src), "-o", str(out)], check=True)
    return PackedGemm(ctypes.CDLL(str(out)))


def linear_table(name: str, n: int, k: int, copies: int, builds: dict[str, PackedGemm], rounds: int) -> None:
    """µs per call by row count, cycling through `copies` distinct packed weights [n, k]."""
    first = next(iter(builds.values()))
    packs = [first.pack(torch.randn(n, k)) for _ in range(copies)]  # one packing format for every build
    names = list(builds)
    print(f"\n{name} ({k} -> {n}), {copies} distinct weights, µs per call")
    print("| rows | " + " | ".join(names) + " | new ÷ base | new GB/s | new GFLOP/s |")
    print("|---:|" + "---:|" * (len(names) + 3))
    for m in ROWS:
        x = torch.randn(m, k)
        outs = [b.linear(x, packs[0], n) for b in builds.values()]
        assert all(torch.equal(o, outs[0]) for o in outs), f"builds disagree at {m} rows"
        times: dict[str, list[float]] = {s: [] for s in names}
        reps = max(1, 60 // copies)
        for _ in range(rounds):
            for s, b in builds.items():
                t = time.perf_counter()
                for _ in range(reps):
                    for p in packs:
                        b.linear(x, p, n)
                times[s].append((time.perf_counter() - t) / (reps * copies))
        med = {s: statistics.median(v) for s, v in times.items()}
        base, new = med[names[0]], med[names[-1]]
        cols = " | ".join(f"{med[s] * 1e6:.0f}" for s in names)
        print(f"| {m} | {cols} | {new / base:.2f} | {n * k * 4 / new / 1e9:.1f} | {2 * m * n * k / new / 1e9:.0f} |")


def forward_table(builds: dict[str, PackedGemm], rounds: int) -> None:
    """Median ms of a k-token forward (total / in linears) with each build swapped into one loaded model."""
    target = load_model("smollm2-135m", dtype="float32", relayout="packed")
    linears = [m for m in target.hf.modules() if isinstance(m, PackedLinear)]
    in_linears = [0.0]
    plain_forward = PackedLinear.forward

    def timed(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        y = plain_forward(self, x)
        in_linears[0] += time.perf_counter() - t
        return y

    PackedLinear.forward = timed
    cache = target.new_cache()
    target.forward(torch.randint(100, 1000, (1, 90)), cache, logits_to_keep=1)
    names = list(builds)
    print("\nSmolLM2-135M forward over k new tokens (90 cached), ms: total / in linears")
    print("| k | " + " | ".join(names) + " | new ÷ base total | new total ÷ new k = 1 |")
    print("|---:|" + "---:|" * (len(names) + 2))
    new_k1 = None
    for k in FORWARD_K:
        new = torch.full((1, k), 100)
        tot: dict[str, list[float]] = {s: [] for s in names}
        lin: dict[str, list[float]] = {s: [] for s in names}
        for _ in range(rounds):
            for s, b in builds.items():
                for m in linears:
                    m.kernel = b
                for _ in range(3):
                    in_linears[0] = 0.0
                    t = time.perf_counter()
                    target.forward(new, cache)
                    cache.crop(90)
                    tot[s].append(time.perf_counter() - t)
                    lin[s].append(in_linears[0])
        med = {s: (statistics.median(tot[s]) * 1e3, statistics.median(lin[s]) * 1e3) for s in names}
        base, newest = med[names[0]][0], med[names[-1]][0]
        new_k1 = newest if k == 1 else new_k1
        cols = " | ".join(f"{a:.1f} / {b:.1f}" for a, b in med.values())
        print(f"| {k} | {cols} | {newest / base:.2f} | {newest / new_k1:.2f} |")
    PackedLinear.forward = plain_forward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-rev", required=True, help="git revision whose packed_gemm.cpp is the baseline")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    rel = SOURCE.relative_to(Path(__file__).resolve().parents[1])
    base_src = subprocess.run(
        ["git", "show", f"{args.base_rev}:{rel}"], check=True, capture_output=True, text=True
    ).stdout
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        builds = {
            f"base {args.base_rev}": build(base_src, Path(tmp) / "base.so"),
            "new": build(SOURCE.read_text(), Path(tmp) / "new.so"),
        }
        print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, threads {torch.get_num_threads()}")
        linear_table("MLP up", 1536, 576, 60, builds, args.rounds)
        linear_table("MLP down", 576, 1536, 60, builds, args.rounds)
        linear_table("LM head", 49152, 576, 1, builds, max(3, args.rounds // 2))
        forward_table(builds, args.rounds)


if __name__ == "__main__":
    main()
