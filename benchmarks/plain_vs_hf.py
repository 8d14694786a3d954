"""byblock's plain decoder vs transformers' generate: same model, prompts, run; greedy, 128 new tokens.

Also reports the fraction of the memory-bandwidth roofline reached: weight bytes per step × tokens/s ÷
measured read bandwidth. Methods are interleaved per prompt (order alternating) so drift hits both alike.

    python benchmarks/plain_vs_hf.py --limit 5 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from byblock import SamplingParams, generate, load_model
from byblock.bench.datasets import load_dev
from byblock.bench.hardware import describe_machine, measure_read_bandwidth, weight_bytes


def hf_generate(model, ids: list[int], n: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    out = model.hf.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(model.eos_token_ids)
    )
    return time.perf_counter() - t, out[0, len(ids) :].tolist()


def ours(model, ids: list[int], n: int) -> tuple[float, list[int]]:
    t = time.perf_counter()
    res = generate(model, ids, SamplingParams(max_new_tokens=n))
    return time.perf_counter() - t, res.token_ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    bw = measure_read_bandwidth()
    print(f"machine: {describe_machine()}; read bandwidth {bw / 1e9:.1f} GB/s")
    rows = []
    for dtype in args.dtypes:
        model = load_model(args.model, dtype=dtype)  # byblock's default: GEMV-friendly weight layout
        hf_model = load_model(args.model, dtype=dtype, relayout=False)  # untouched transformers model
        prompts = [model.encode_prompt(p.text, chat=True) for p in load_dev(args.limit)]
        hf_generate(hf_model, prompts[0], 8)  # warm-up, excluded
        ours(model, prompts[0], 8)
        t_hf, t_ours, same, n_tokens = [], [], True, 0
        for i, ids in enumerate(prompts):
            runs = [("hf", hf_generate, hf_model), ("ours", ours, model)]
            results = {name: fn(m, ids, args.max_new_tokens) for name, fn, m in (runs if i % 2 == 0 else runs[::-1])}
            t_hf.append(results["hf"][0])
            t_ours.append(results["ours"][0])
            same &= results["hf"][1] == results["ours"][1]
            n_tokens += len(results["ours"][1])
        tps_hf = n_tokens / sum(t_hf)
        tps_ours = n_tokens / sum(t_ours)
        wb = weight_bytes(model.hf)
        row = {
            "dtype": dtype,
            "prompts": len(prompts),
            "new_tokens": n_tokens,
            "hf_tok_s": round(tps_hf, 2),
            "byblock_tok_s": round(tps_ours, 2),
            "ratio": round(tps_ours / tps_hf, 3),
            "ratio_median_per_prompt": round(statistics.median(a / b for a, b in zip(t_hf, t_ours, strict=True)), 3),
            "identical_tokens": same,
            "weight_MB": round(wb / 1e6, 1),
            "roofline_tok_s": round(bw / wb, 1),
            "roofline_fraction": round(tps_ours * wb / bw, 3),
        }
        rows.append(row)
        print(
            f"{dtype:9s} hf {tps_hf:6.2f} tok/s | byblock {tps_ours:6.2f} tok/s | ratio {row['ratio']:.3f} | "
            f"identical {same} | roofline {row['roofline_tok_s']} tok/s, reached {row['roofline_fraction']:.1%}"
        )
    print(json.dumps({"bandwidth_GBps": round(bw / 1e9, 2), "rows": rows}))


if __name__ == "__main__":
    main()
