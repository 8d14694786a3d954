"""Retrieval accuracy, time to first token and KV memory for every long-prompt setting, side by side.

    .venv/bin/python benchmarks/passkey.py [--model smollm2-135m] [--lengths 1024,2048,4096]
        [--depths 0.1,0.5,0.9] [--keys 1,3] [--update-results benchmarks/RESULTS.md --section passkey]

Settings: dense, Stem (sparsity 0.75), int8 and int4 KV, StreamingLLM (4 sinks + 512 window), SnapKV
(256 kept + 64 window). Raw prompts (no chat template), greedy, 8 new tokens.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

import torch

SETTINGS = {
    "dense": {},
    "stem-0.75": {"sparse": 0.75},
    "int8-kv": {"kv_bits": 8},
    "int4-kv": {"kv_bits": 4},
    "streaming-4+512": {"window": (4, 512)},
    "snapkv-256": {"snap": 256},
}


def load(model_name: str, setting: dict):
    """A fresh model with one long-prompt setting applied."""
    from byblock.attention.hf_stem import enable_stem
    from byblock.attention.stem import StemConfig
    from byblock.models.kv_cache import StreamingWindow
    from byblock.models.loading import load_model
    from byblock.models.snapkv import SnapKVConfig, enable_snapkv

    model = load_model(model_name)
    if "sparse" in setting:
        enable_stem(model.hf, StemConfig(sparsity=setting["sparse"], min_tokens=1024))
    model.kv_bits = setting.get("kv_bits")
    if "window" in setting:
        model.kv_window = StreamingWindow(*setting["window"])
    if "snap" in setting:
        model.snapkv = enable_snapkv(model.hf, SnapKVConfig(budget=setting["snap"]))
    return model


def kv_bytes(model, ids: list[int]) -> int:
    """Bytes of the cache right after prefilling `ids` (after any compression)."""
    cache = model.new_cache()
    with torch.inference_mode():
        model.forward(torch.tensor([ids]), cache, logits_to_keep=1)
    cache.evict()
    return cache.nbytes()


def run(model_name: str, lengths: list[int], depths: list[float], keys: list[int]) -> list[dict]:
    """One row per setting and length: accuracy over depths x key counts, mean TTFT, KV bytes."""
    from byblock.bench.passkey import correct, make_prompt
    from byblock.engine.api import generate
    from byblock.sampling.params import SamplingParams

    rows = []
    params = SamplingParams(max_new_tokens=8)
    for name, setting in SETTINGS.items():
        model = load(model_name, setting)
        for length in lengths:
            prompts = [make_prompt(model.tokenizer, length, d, k) for d in depths for k in keys]
            ok, ttft = 0, []
            generate(model, prompts[0].text, params, chat=False)  # warm-up (Stem compiles its kernel per shape)
            for p in prompts:
                res = generate(model, p.text, params, chat=False)
                ttft.append(res.ttft_s)
                ok += correct(p, res.text)
            ids = model.encode_prompt(prompts[0].text, chat=False)
            row = {
                "setting": name,
                "length": length,
                "prompt_tokens": len(ids),
                "accuracy": ok / len(prompts),
                "n": len(prompts),
                "ttft_s": sum(ttft) / len(ttft),
                "kv_mb": kv_bytes(model, ids) / 2**20,
            }
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """The RESULTS.md table."""
    dense = {r["length"]: r for r in rows if r["setting"] == "dense"}
    lines = [
        "| setting | prompt tokens | accuracy | Δ vs dense (points) | mean TTFT s | vs dense | KV MB after prefill |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = dense[r["length"]]
        delta = (r["accuracy"] - d["accuracy"]) * 100
        lines.append(
            f"| {r['setting']} | {r['prompt_tokens']} | {r['accuracy']:.0%} ({r['n']}) | {delta:+.0f} | "
            f"{r['ttft_s']:.2f} | {d['ttft_s'] / r['ttft_s']:.2f}× | {r['kv_mb']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run the grid, print the table, optionally write a RESULTS.md section."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--keys", default="1,3")
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default=None)
    args = p.parse_args()
    rows = run(
        args.model,
        [int(x) for x in args.lengths.split(",")],
        [float(x) for x in args.depths.split(",")],
        [int(x) for x in args.keys.split(",")],
    )
    table = markdown(rows)
    print(table)
    if args.update_results:
        from byblock.bench.report import replace_section

        cmd = "python benchmarks/passkey.py " + shlex.join(sys.argv[1:])
        replace_section(
            Path(args.update_results), args.section, f"Measured {datetime.date.today()}, `{cmd}`.\n\n{table}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
