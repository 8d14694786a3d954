"""Sparse decode/verify attention on this CPU: one layer's attention for new rows over a long cache, dense SDPA
vs `--sparse-decode K` (attention/sparse_decode.py), at the model's head shapes.

    .venv/bin/python benchmarks/sparse_decode.py [--lengths 8192,16384,32768] [--rows 1,16] [--blocks 8,16]
        [--model smollm2-135m --e2e-lengths 2048,4096,8000] [--update-results benchmarks/RESULTS.md --section S]

Attention only: dense is byblock's decode kernel (kernels/gqa_sdpa.py: the CPU row kernel over every visible
key, in place); sparse is the whole `--sparse-decode` path (visible keys, block extremes, the Quest bound,
top-K per KV head, the row kernel over the chosen keys), with the block extremes kept between calls as the
KV cache keeps them (kv/block_summary.py). End to end (--model): one process prefills a random prompt once, then
times forwards of the loaded model as `byblock generate` runs them — 1 new row (a decode step) and R rows (a
chain verify) — dense and with each K, interleaved over three rounds on the same cache (cropped back after each
forward), median per setting. Ratios come from one run.
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
from byblock.kv.block_summary import KeyBlockSummary


def median_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in ms (one warm-up call first)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times)[len(times) // 2]


class _Module(torch.nn.Module):
    is_causal = True


def dense(q, k, v, scale):
    """The dense decode attention byblock runs: new rows last, causal among themselves (kernels/gqa_sdpa.py)."""
    from byblock.kernels.gqa_sdpa import gqa_sdpa_attention_forward

    lq, lk = q.shape[2], k.shape[2]
    mask = None if lq == 1 else torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)[None, None]
    return gqa_sdpa_attention_forward(_Module(), q, k, v, mask, scaling=scale)[0]


def end_to_end(args) -> list[dict]:
    """Decode-step ms of the loaded model, dense and per K, at each prompt length (see the module docstring)."""
    from byblock.attention.hf_stem import enable_stem
    from byblock.attention.stem import StemConfig
    from byblock.kernels.gqa_sdpa import NAME as DENSE
    from byblock.models.loading import load_model

    model = load_model(args.model)
    confs = {id(c): c for c in (model.hf.config, model.hf.config.get_text_config())}.values()
    out = []
    for length in [int(x) for x in args.e2e_lengths.split(",")]:
        ids = torch.randint(100, 20000, (1, length), generator=torch.Generator().manual_seed(length))
        cache = model.new_cache()
        model.forward(ids, cache, logits_to_keep=1)
        times: dict[tuple[int, int], list[float]] = {}
        for _ in range(3):
            for k in [0, *[int(x) for x in args.blocks.split(",")]]:
                if k:
                    cfg = StemConfig(
                        prefill=False, decode_blocks=k, decode_window=args.window, decode_min_tokens=args.min_tokens
                    )
                    enable_stem(model.hf, cfg)
                else:  # back to byblock's own decoder and kernel
                    for conf in confs:
                        conf.byblock_stem = None
                    model.hf.set_attn_implementation(DENSE)
                for rows in [int(x) for x in args.e2e_rows.split(",")]:
                    tok = torch.full((1, rows), 42)  # rows > 1: a chain verify of that many tokens
                    model.forward(tok, cache, logits_to_keep=rows)  # warm-up forward
                    cache.crop(length)
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        model.forward(tok, cache, logits_to_keep=rows)
                        times.setdefault((k, rows), []).append(time.perf_counter() - t)
                        cache.crop(length)
        for (k, rows), ts in times.items():
            if k:
                dense_ts = times[(0, rows)]
                out.append(
                    {"length": length, "rows": rows, "blocks": k, "dense_ms": 1000 * sorted(dense_ts)[len(ts) // 2],
                     "sparse_ms": 1000 * sorted(ts)[len(ts) // 2]}
                )  # fmt: skip
                print(out[-1], file=sys.stderr, flush=True)
    return out


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
                summary = KeyBlockSummary(args.block)  # as a cache keeps them: filled by the warm-up call

                def sparse(q=q, k=k, v=v, blocks=blocks, summary=summary):
                    return sparse_decode_attention(q, k, v, None, scale, args.block, blocks, args.window, 1, summary)

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


def e2e_markdown(rows: list[dict], args) -> str:
    """The end-to-end table."""
    out = [
        f"End to end, `{args.model}` as loaded (default dtype and kernels), one forward of 1 new row (a decode "
        f"step) or of R rows (a chain verify), median of {3 * args.steps} over 3 interleaved rounds on the same "
        f"cache, window {args.window}, --sparse-decode-min-tokens {args.min_tokens}:",
        "",
        "| prompt tokens | rows | K blocks | dense ms/forward | sparse ms/forward | speedup |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (r["length"], r["rows"], r["blocks"])):
        out.append(
            f"| {r['length']} | {r['rows']} | {r['blocks']} | {r['dense_ms']:.1f} | {r['sparse_ms']:.1f} | "
            f"{r['dense_ms'] / r['sparse_ms']:.2f}× |"
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
    p.add_argument("--model", default=None, help="also time whole decode steps of this model")
    p.add_argument("--e2e-lengths", default="2048,4096,8000")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--e2e-rows", default="1,16", help="end to end: new rows per forward (1: decode, R: a verify)")
    p.add_argument(
        "--min-tokens", type=int, default=0, help="end to end: --sparse-decode-min-tokens (0: sparse everywhere)"
    )
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default=None)
    args = p.parse_args()
    table = markdown(measure(args), args) if args.lengths else ""
    if args.model:
        table += ("\n" if table else "") + e2e_markdown(end_to_end(args), args)
    print(table)
    if args.update_results:
        from byblock.bench.report import replace_section

        cmd = "python benchmarks/sparse_decode.py " + shlex.join(sys.argv[1:])
        body = f"Measured {datetime.date.today().isoformat()}, `{cmd}`.\n\n{table}"
        replace_section(Path(args.update_results), args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
