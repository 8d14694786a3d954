"""Why a k-token verify can cost several plain steps, and what byblock's packed GEMM changes: fp32 by row count.

Two measurements, one thread: (1) one SmolLM2 MLP-shaped linear (576 -> 1536, fp32, in cache) and the LM head
(576 -> 49152, 113 MB, streamed from memory) at m = 1..32 rows: time per call for `F.linear` (weights [out, in]),
`x @ W_t` (weights [in, out], byblock's fp32 layout before session 11) and byblock's packed-panel kernel
(kernels/packed_gemm.py); (2) the whole target, one forward over k new tokens after a 90-token prompt (the cache
is cropped back after each call), median ms and the ratio to k = 1 (the round cost of a k−1 token chain before
drafting), with the [in, out] linears and with the packed ones.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/small_gemm_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from byblock.kernels.cpu_features import native_bf16
from byblock.kernels.packed_gemm import PackedLinear, load_kernel
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


def linear_table(name: str, w: torch.Tensor, kernel) -> None:
    """Per-call µs and GFLOP/s by row count for the three kernels, one weight [out, in]."""
    w_t = w.t().contiguous()  # [in, out]
    packed = PackedLinear(w, None, kernel) if kernel is not None else None
    n, k = w.shape
    print(f"\n{name} ({k} -> {n})")
    print("| rows | F.linear µs | x @ W_t µs | packed µs | packed GFLOP/s |\n|---:|---:|---:|---:|---:|")
    repeats = max(5, int(2e8 / w.numel()))
    for m in (1, 2, 4, 8, 16, 32):
        x = torch.randn(m, k)
        a = per_call_s(lambda x=x: F.linear(x, w), repeats)
        b = per_call_s(lambda x=x: x @ w_t, repeats)
        c = per_call_s(lambda x=x: packed(x), repeats) if packed is not None else float("nan")
        flop = 2 * m * n * k
        print(f"| {m} | {a * 1e6:.0f} | {b * 1e6:.0f} | {c * 1e6:.0f} | {flop / c / 1e9:.1f} |")


def forward_costs(relayout: bool | str) -> dict[int, float]:
    """Median ms of one target forward over k new tokens after a 90-token prompt."""
    target = load_model("smollm2-135m", dtype="float32", relayout=relayout)
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
    return ms


def main() -> None:
    torch.manual_seed(0)
    kernel = load_kernel()
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16 {native_bf16()}, "
        f"packed kernel {'yes' if kernel is not None else 'unavailable'}"
    )
    with torch.no_grad():
        linear_table("MLP up", torch.randn(1536, 576), kernel)
        linear_table("LM head", torch.randn(49152, 576), kernel)
        inout = forward_costs("inout")
        packed = forward_costs(True) if kernel is not None else {}
    print("\n| k new tokens | [in, out] ms | ÷ k = 1 | packed ms | ÷ k = 1 | packed ÷ [in, out] k = 1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for k, v in inout.items():
        p = packed.get(k, float("nan"))
        p1 = packed.get(1, float("nan"))
        print(f"| {k} | {v:.1f} | {v / inout[1]:.2f} | {p:.1f} | {p / p1:.2f} | {p / inout[1]:.2f} |")


if __name__ == "__main__":
    main()
