"""Sparse decode/verify attention on this CPU: one layer's attention for new rows over a long cache, dense SDPA
vs `--sparse-decode K` (attention/sparse_decode.py), at the model's head shapes.

    .venv/bin/python benchmarks/sparse_decode.py [--lengths 8192,16384,32768] [--rows 1,16] [--blocks 8,16]
        [--update-results benchmarks/RESULTS.md --section sparse-decode]

Dense is what a decode step runs today (transformers' SDPA path: K/V repeated to the query heads, then SDPA
with the causal mask of the new rows). Sparse is the whole per-row path: visible keys, block extremes over the
cache (recomputed every forward), the Quest bound, top-K, gather and SDPA per row. Ratios come from one run.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

import torch

from byblock.attention.sparse_decode import sparse_decode_attention


def median_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in ms (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


def dense(q, k, v, scale):
    """The dense decode attention: new rows last, causal among themselves."""
    lq, lk = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask, scale=scale
    )


def measure(args) -> list[dict]:
    """One row per (length, rows, blocks): dense ms, sparse ms, density."""
    rows = []
    scale = args.head_dim**-0.5
    for length in [int(x) for x in args.lengths.split(",")]:
        g = torch.Generator().manual_seed(length)
        for lq in [int(x) for x in args.rows.split(",")]:
            q = torch.randn(1, args.heads, lq, args.head_dim, generator=g)
            k, v = (torch.randn(1, args.kv_heads, length, args.head_dim, generator=g) for _ in range(2))
            dense_ms = median_ms(lambda q=q, k=k, v=v: dense(q, k, v, scale), args.repeats)
            for blocks in [int(x) for x in args.blocks.split(",")]:

                def sparse(q=q, k=k, v=v, blocks=blocks):
                    return sparse_decode_attention(q, k, v, None, scale, args.block, blocks, args.window, 1)

                ms = median_ms(sparse, args.repeats)
                rows.append(
                    {"length": length, "rows": lq, "blocks": blocks, "density": sparse()[1], "dense_ms": dense_ms,
                     "sparse_ms": ms}
                )  # fmt: skip
                print(rows[-1], file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict], args) -> str:
    """The RESULTS.md table."""
    out = [
        f"One attention layer, {args.heads} query / {args.kv_heads} KV heads × {args.head_dim} (SmolLM2-135M), fp32, "
        f"block {args.block}, window {args.window}, 1 sink block; median of {args.repeats}.",
        "",
        "| cache tokens | new rows | K blocks | keys read | dense ms | sparse ms | speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['length']} | {r['rows']} | {r['blocks']} | {r['density']:.1%} | {r['dense_ms']:.2f} | "
            f"{r['sparse_ms']:.2f} | {r['dense_ms'] / r['sparse_ms']:.2f}× |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    """Measure, print the table, optionally write a RESULTS.md section."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="8192,16384,32768")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--blocks", default="8,16")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default=None)
    args = p.parse_args()
    table = markdown(measure(args), args)
    print(table)
    if args.update_results:
        from byblock.bench.report import replace_section

        cmd = "python benchmarks/sparse_decode.py " + shlex.join(sys.argv[1:])
        body = f"Measured {datetime.date.today().isoformat()}, `{cmd}`.\n\n{table}"
        replace_section(Path(args.update_results), args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
