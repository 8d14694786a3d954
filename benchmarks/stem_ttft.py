"""Stem sparse prefill on this CPU: attention-only speedup and end-to-end time to first token.

    .venv/bin/python benchmarks/stem_ttft.py [--lengths 4096,8192] [--attn-lengths 4096,8192,16384,32768]
        [--model smollm2-135m] [--share-layers 1,2,4] [--update-results benchmarks/RESULTS.md --section stem-cpu]

Part A (attention only): one layer's causal attention with the model's head shapes — SDPA vs Stem
(scoring + selection + the flex block-sparse kernel), after a warm-up call that compiles the kernel.
Part B (end to end): prefill + first token of the model on a long synthetic prompt, dense vs Stem, each
after one warm-up run of the same length. Ratios are measured in the same run (this machine is noisy).
"""

from __future__ import annotations

import argparse
import datetime
import random
import shlex
import sys
import time
from pathlib import Path

import torch


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls."""
    times = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention (the baseline)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_only(
    lengths: list[int], heads: int, head_dim: int, sparsities: list[float], repeats: int, device: str = "cpu"
) -> list[dict]:
    """SDPA vs Stem for one layer at each length and sparsity (on `device`: cpu or cuda)."""
    from byblock.attention.stem import (
        DensityLog,
        StemConfig,
        block_sparse_attention_flex,
        causal_density,
        oam_block_logits,
        select_blocks,
        tpd_budgets,
    )

    rows = []
    for length in lengths:
        g = torch.Generator().manual_seed(length)
        q, k, v = (torch.randn(1, heads, length, head_dim, generator=g).to(device) for _ in range(3))
        scale = head_dim**-0.5
        dense = median_time(lambda q=q, k=k, v=v: sdpa_causal(q, k, v), repeats)
        for sp in sparsities:
            cfg = StemConfig(sparsity=sp)
            log = DensityLog()
            state: dict = {}

            def score(cfg=cfg, state=state, q=q, k=k, v=v, scale=scale, length=length):
                logits = oam_block_logits(q, k, v, cfg, scale)
                state["mask"] = select_blocks(logits, tpd_budgets(length // cfg.block_size, cfg), cfg)

            def kernel(cfg=cfg, state=state, log=log, q=q, k=k, v=v, scale=scale):
                block_sparse_attention_flex(q, k, v, state["mask"], cfg.block_size, scale, log)

            score()
            kernel()  # compiles for this shape; excluded
            t_score = median_time(score, repeats)
            t_kernel = median_time(kernel, repeats)
            rows.append(
                {
                    "length": length,
                    "sparsity": sp,
                    "density": causal_density(state["mask"]),
                    "sdpa_s": dense,
                    "score_s": t_score,
                    "kernel_s": t_kernel,
                    "speedup": dense / (t_score + t_kernel),
                    "kernel_speedup": dense / t_kernel,
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def synthetic_prompt(tokenizer, tokens: int) -> list[int]:
    """A deterministic prose-like prompt of exactly `tokens` tokens."""
    rng = random.Random(0)
    words = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on"]
    text = " ".join(rng.choice(words) for _ in range(tokens * 2))
    return tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]


def end_to_end(
    model_name: str,
    lengths: list[int],
    sparsities: list[float],
    warmup_max: int = 1 << 30,
    share_layers: tuple[int, ...] = (1,),
) -> list[dict]:
    """TTFT (prefill + first token) dense vs Stem (each sparsity × each `--sparse-share-layers N`); lengths
    above `warmup_max` run once, without a warm-up (minutes per prefill on this CPU: Stem's time then includes
    compiling its kernel for that shape)."""
    from byblock.attention.hf_stem import enable_stem
    from byblock.attention.stem import StemConfig
    from byblock.engine.api import generate
    from byblock.models.loading import load_model
    from byblock.sampling.params import SamplingParams

    rows = []
    settings: list[tuple[float | None, int]] = [(None, 1), *[(sp, n) for sp in sparsities for n in share_layers]]
    for sp, share in settings:
        model = load_model(model_name)
        cfg = StemConfig(sparsity=sp, share_layers=share) if sp is not None else None
        density = enable_stem(model.hf, cfg) if cfg is not None else None
        for length in lengths:
            ids = synthetic_prompt(model.tokenizer, length)
            params = SamplingParams(max_new_tokens=1)
            if length <= warmup_max:
                generate(model, ids, params)  # warm-up (and flex compile for this length)
            t = time.perf_counter()
            res = generate(model, ids, params)
            ttft = time.perf_counter() - t
            row = {"length": length, "sparsity": sp, "share": share, "ttft_s": ttft, "token": res.token_ids[0]}
            row["weights"] = model.weights
            row["warm"] = length <= warmup_max
            if density is not None:
                row["density"] = density.mean()
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


def markdown(attn: list[dict], e2e: list[dict], model: str) -> str:
    """The RESULTS.md tables."""
    header = (
        "| prompt tokens | sparsity | density | SDPA ms | Stem scoring ms | Stem kernel ms | speedup | kernel only |"
    )
    out = [] if not attn else ["Attention only (one layer, causal, the model's head shapes):", "", header]
    if attn:
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in attn:
        ms = {key: r[key] * 1e3 for key in ("sdpa_s", "score_s", "kernel_s")}
        out.append(
            f"| {r['length']} | {r['sparsity']} | {r['density']:.3f} | {ms['sdpa_s']:.1f} | {ms['score_s']:.1f} | "
            f"{ms['kernel_s']:.1f} | {r['speedup']:.2f}× | {r['kernel_speedup']:.2f}× |"
        )
    dense = {r["length"]: r for r in e2e if r["sparsity"] is None}
    if not e2e:
        return "\n".join(out) + "\n"
    out += [
        "",
        f"End to end, `{model}` ({e2e[0].get('weights', 'float32')} weights), prefill + first token, "
        f"{torch.get_num_threads()} thread(s):",
        "",
        "| prompt tokens | setting | mean density (sparse layers) | TTFT s | vs dense | same first token | warmed up |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for r in e2e:
        base = dense[r["length"]]
        name = "dense" if r["sparsity"] is None else f"stem {r['sparsity']}"
        if r.get("share", 1) > 1:
            name += f", index shared by {r['share']} layers"
        dens = f"{r['density']:.3f}" if "density" in r else "1.000"
        same = "yes" if r["token"] == base["token"] else "no"
        out.append(
            f"| {r['length']} | {name} | {dens} | {r['ttft_s']:.2f} | {base['ttft_s'] / r['ttft_s']:.2f}× | {same} | "
            f"{'yes' if r.get('warm', True) else 'no'} |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    """Run both parts, print the tables, optionally write a RESULTS.md section."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="4096,8000")
    p.add_argument("--attn-lengths", default="4096,8192,16384,32768")
    p.add_argument("--sparsities", default="0.75,0.9")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--share-layers", default="1", help="end to end: Stem's index shared by N layers, e.g. 1,2,4")
    p.add_argument("--warmup-max", type=int, default=1 << 30, help="longer prompts run once, without a warm-up")
    p.add_argument("--device", default="cpu", help="attention-only part: cpu or cuda")
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default=None)
    args = p.parse_args()
    sparsities = [float(x) for x in args.sparsities.split(",")]
    attn_lengths = [int(x) for x in args.attn_lengths.split(",") if x]
    attn = attention_only(attn_lengths, args.heads, args.head_dim, sparsities, args.repeats, args.device)
    e2e_lengths = [int(x) for x in args.lengths.split(",") if x]
    shares = tuple(int(x) for x in args.share_layers.split(","))
    e2e = end_to_end(args.model, e2e_lengths, sparsities, args.warmup_max, shares) if e2e_lengths else []
    table = markdown(attn, e2e, args.model)
    print(table)
    if args.update_results:
        from byblock.bench.report import replace_section

        cmd = "python benchmarks/stem_ttft.py " + shlex.join(sys.argv[1:])
        body = f"Measured {datetime.date.today().isoformat()}, `{cmd}`.\n\n{table}"
        replace_section(Path(args.update_results), args.section, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
