"""What row invariance costs a plain bf16 decode step and a 16-token verify (same process, interleaved).

Variants of SmolLM2-135M in bf16: `invariant` (byblock's default), `invariant, gathered chains` (the same, but
chains take the per-row gather path trees take: what session 5 shipped), `linears only` (padded linears, SDPA
attention), `attention only` (invariant attention, unpadded linears), `plain` (neither). Median ms per forward
after a 90-token prompt, 5 interleaved repetitions.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/row_invariance_cost.py
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from byblock.kernels.invariant import NAME, RowInvariantLinear, RowPlan
from byblock.models.loading import load_model


def ms_per_forward(target, ids: torch.Tensor, steps: int, k: int) -> float:
    cache = target.new_cache()
    target.forward(ids, cache, logits_to_keep=1)
    t0 = time.perf_counter()
    for _ in range(steps):
        target.forward(torch.full((1, k), 100), cache)
    return (time.perf_counter() - t0) / steps * 1000


def main() -> None:
    inv = load_model("smollm2-135m", dtype="bfloat16")
    plain = load_model("smollm2-135m", dtype="bfloat16", relayout=False, row_invariant=False)
    prompt = "Write a Python function that checks whether a number is prime, and explain it in detail. " * 3
    ids = torch.tensor([inv.encode_prompt(prompt, True)])
    padded = RowInvariantLinear.forward

    def unpadded(self, x):
        return F.linear(x, self.weight, self.bias)

    sliced = RowPlan.build

    def gathered(past, visible):
        plan = sliced(past, visible)
        return None if plan is None else replace(plan, chain=False)

    variants = {
        "invariant": (inv, NAME, padded),
        "invariant, gathered chains": (inv, NAME, padded),
        "linears only": (inv, "sdpa", padded),
        "attention only": (inv, NAME, unpadded),
        "plain": (plain, None, padded),
    }
    one: dict[str, list[float]] = {n: [] for n in variants}
    block: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(5):
        for name, (target, attn, fwd) in variants.items():
            RowInvariantLinear.forward = fwd
            RowPlan.build = staticmethod(gathered if name == "invariant, gathered chains" else sliced)
            if attn:
                target.hf.set_attn_implementation(attn)
            one[name].append(ms_per_forward(target, ids, 16, 1))
            block[name].append(ms_per_forward(target, ids, 6, 16))
            RowInvariantLinear.forward = padded
            inv.hf.set_attn_implementation(NAME)
    print(f"prompt {ids.shape[1]} tokens, {torch.get_num_threads()} thread(s)")
    print("| variant | ms, 1 token | ms, 16 tokens |\n|---|---:|---:|")
    for name in variants:
        print(f"| {name} | {statistics.median(one[name]):.1f} | {statistics.median(block[name]):.1f} |")


if __name__ == "__main__":
    main()
