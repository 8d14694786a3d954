"""Why a k-token verify can cost several plain steps: fp32 GEMM throughput by row count on this CPU.

Two measurements, one thread: (1) one SmolLM2 MLP-shaped linear (576 -> 1536, fp32) at m = 1..64 rows, time
per call and GFLOP/s, for `F.linear` (weights [out, in]) and `x @ W_t` (weights [in, out], byblock's fp32
layout); (2) the whole target, byblock's default fp32 load, one forward over k new tokens after a 90-token
prompt (the cache is cropped back after each call), median ms and the ratio to k = 1, i.e. the round cost
of a k−1 token chain before drafting. Where small-m GEMMs are compute-bound (AVX2, no AVX-512) the ratio
grows almost linearly past a few rows, and block drafting cannot pay.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/small_gemm_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from byblock.models.cpu_features import native_bf16
from byblock.models.loading import load_model


def per_call_s(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` timed calls after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {native_bf16()}")
    w = torch.randn(1536, 576)  # [out, in]
    w_t = w.t().contiguous()  # [in, out]
    print("| rows | F.linear µs | GFLOP/s | x @ W_t µs | GFLOP/s |\n|---:|---:|---:|---:|---:|")
    for m in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(m, 576)
        a = per_call_s(lambda x=x: F.linear(x, w), 200)
        b = per_call_s(lambda x=x: x @ w_t, 200)
        flop = 2 * m * 576 * 1536
        print(f"| {m} | {a * 1e6:.0f} | {flop / a / 1e9:.1f} | {b * 1e6:.0f} | {flop / b / 1e9:.1f} |")
    target = load_model("smollm2-135m", dtype="float32")
    prompt = torch.randint(100, 1000, (1, 90))
    cache = target.new_cache()
    target.forward(prompt, cache, logits_to_keep=1)
    ms = {}
    for k in (1, 2, 3, 5, 9, 17, 32):
        new = torch.full((1, k), 100)

        def step(new=new) -> None:
            target.forward(new, cache)
            cache.crop(90)

        ms[k] = per_call_s(step, 7) * 1000
    print("\n| k new tokens | ms per forward | ÷ k = 1 |\n|---:|---:|---:|")
    for k, v in ms.items():
        print(f"| {k} | {v:.1f} | {v / ms[1]:.2f} |")


if __name__ == "__main__":
    main()
