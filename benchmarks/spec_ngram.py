"""Prompt lookup (ngram) vs plain decoding on the default model, and the verify-cost curve.

Greedy, batch 1, dev prompts (chat) and HumanEval prompts (raw completion), methods interleaved per
prompt. Every speculative run is checked token-identical to plain decoding. Then the cost of one target
forward over k = 1..32 new tokens relative to k = 1 (what decides block sizes on this machine).

    python benchmarks/spec_ngram.py --limit 10 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from byblock import SamplingParams, generate, load_model
from byblock.bench.datasets import load_dev, load_humaneval
from byblock.bench.hardware import describe_machine
from byblock.drafters import NgramConfig, NgramDrafter

METHODS = {
    "plain": None,
    "ngram-b8": NgramConfig(block_size=8),
    "ngram-tree-b8x4": NgramConfig(block_size=8, num_candidates=4, tree_budget=24),
}


def forward_cost_curve(model, context: int = 256, ks=(1, 2, 4, 8, 16, 32), repeats: int = 7) -> dict[int, float]:
    """Median seconds of one forward of k new tokens after `context` cached tokens."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (1, context + max(ks)), generator=g)
    cache = model.new_cache()
    model.forward(ids[:, :context], cache, logits_to_keep=1)
    out = {}
    for k in ks:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            model.forward(ids[:, context : context + k], cache)
            times.append(time.perf_counter() - t)
            cache.crop(context)
        out[k] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    print(f"machine: {describe_machine()}")
    model = load_model(args.model, dtype=args.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    datasets = {"dev": load_dev(args.limit), "humaneval": load_humaneval(args.limit)}
    generate(model, "warm up", SamplingParams(max_new_tokens=8))
    report: dict = {"machine": describe_machine(), "model": args.model, "dtype": args.dtype, "datasets": {}}
    for ds_name, prompts in datasets.items():
        agg = {m: {"tokens": 0, "time": 0.0, "rounds": 0, "emitted": 0, "identical": True} for m in METHODS}
        for i, prompt in enumerate(prompts):
            ids = model.encode_prompt(prompt.text, chat=prompt.chat)
            names = list(METHODS) if i % 2 == 0 else list(METHODS)[::-1]
            results = {}
            for name in names:
                cfg = METHODS[name]
                drafter = NgramDrafter(cfg) if cfg else None
                results[name] = generate(model, ids, params, drafter=drafter)
            for name, res in results.items():
                a = agg[name]
                a["tokens"] += res.num_new_tokens
                a["time"] += res.total_s
                a["rounds"] += res.stats.rounds
                a["emitted"] += res.stats.emitted_by_rounds
                a["identical"] &= res.token_ids == results["plain"].token_ids
        base = agg["plain"]["tokens"] / agg["plain"]["time"]
        table = {}
        for name, a in agg.items():
            tps = a["tokens"] / a["time"]
            table[name] = {
                "tok_s": round(tps, 2),
                "speedup": round(tps / base, 3),
                "tau": round(a["emitted"] / a["rounds"], 3) if a["rounds"] else 1.0,
                "identical": a["identical"],
                "tokens": a["tokens"],
            }
            print(
                f"{ds_name:9s} {name:16s} {tps:6.2f} tok/s  x{tps / base:.2f}  τ {table[name]['tau']:.2f}  "
                f"identical {a['identical']}"
            )
        report["datasets"][ds_name] = {"prompts": len(prompts), "methods": table}
    # The verify-cost curve, for byblock's default [in, out] weight layout and for transformers' own layout.
    for label, m in (("in-out", model), ("out-in", load_model(args.model, dtype=args.dtype, relayout=False))):
        curve = forward_cost_curve(m)
        report[f"forward_ms_{label}"] = {str(k): round(v * 1e3, 2) for k, v in curve.items()}
        report[f"forward_cost_{label}"] = {str(k): round(v / curve[1], 3) for k, v in curve.items()}
        print(f"forward ms ({label} layout):", report[f"forward_ms_{label}"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
