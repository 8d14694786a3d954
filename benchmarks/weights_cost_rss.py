"""Per weight format: the verify-cost curve (one target forward over k = 1…32 new tokens after 256 cached ones),
plain tok/s and peak RSS, each format in its own process; and llama-server's peak RSS on the same GGUF.

Quantized decoding turns compute-bound sooner than fp32 (fewer bytes per weight, the same FLOPs), so a k-row
verify costs more plain steps there: the adaptive drafters must see that curve, not fp32's.

    python benchmarks/weights_cost_rss.py --weights fp32,int8,int4,gguf,gguf/fp32 [--llama-server PATH]

A format may name the quantized linears' activations after a slash (gguf/fp32: the GGUF's blocks on fp32
activations; the default is load_model's, int8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

KS = (1, 2, 4, 8, 16, 32)


def child(spec: str) -> None:
    """Load the default model with `spec` (weights[/activations]), measure, print one JSON line."""
    import torch
    from spec_ngram import forward_cost_curve  # the same curve as RESULTS §2

    from byblock import SamplingParams, generate, load_model

    torch.set_num_threads(os.cpu_count() or 1)
    weights, _, activations = spec.partition("/")
    model = load_model("smollm2-135m", weights=weights, activations=activations or "int8")
    curve = forward_cost_curve(model, ks=KS)
    params = SamplingParams(max_new_tokens=96, ignore_eos=True)
    prompt = "Write a Python function that returns the first n prime numbers."
    generate(model, prompt, params)  # warm-up
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        r = generate(model, prompt, params)
        best = max(best, len(r.token_ids) / (time.perf_counter() - t))
    print(json.dumps({"weights": model.weights, "curve_ms": {k: v * 1e3 for k, v in curve.items()}, "tok_s": best}))


def run_child(weights: str) -> dict:
    """One format in a fresh process; its peak RSS from wait4."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", weights], stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"weights_cost_rss: the {weights} run failed (status {status})")
    row = json.loads(out.strip().splitlines()[-1])
    row["rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
    return row


def llama_rss(binary: str) -> float:
    """llama-server's peak RSS (MiB) after one 96-token answer on the default model's GGUF."""
    from byblock import load_model
    from byblock.handoff.export import target_gguf_of
    from byblock.handoff.llamacpp_peer import LlamaCppConfig, LlamaCppPeer, find_llama_server

    model = load_model("smollm2-135m", weights="fp32", relayout=False)
    ids = model.tokenizer("Write a Python function that returns the first n prime numbers.")["input_ids"]
    cfg = LlamaCppConfig(target_gguf=str(target_gguf_of("smollm2-135m", None)))
    peer = LlamaCppPeer(cfg, find_llama_server(binary), frozenset(model.eos_token_ids))
    try:
        peer.generate([ids], 96, 0.0, 1.0, 0)
        with open(f"/proc/{peer.proc.pid}/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM:"))
        return int(hwm.split()[1]) / 1024
    finally:
        peer.close()


def main() -> None:
    """Parse flags, run each format, print the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="fp32,int8,int4,gguf,gguf/fp32")
    ap.add_argument("--llama-server", default=os.environ.get("BYBLOCK_LLAMA_SERVER"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    from byblock.bench.hardware import describe_machine

    rows = [run_child(w) for w in args.weights.split(",")]
    print(f"Host: {describe_machine()}; SmolLM2-135M, 256 cached tokens, median of 7; tok/s = plain, 96 tokens\n")
    print("| weights | " + " | ".join(f"k={k} ms (×k=1)" for k in KS) + " | plain tok/s | peak RSS MiB |")
    print("|---|" + "---:|" * (len(KS) + 2))
    for r in rows:
        c = {int(k): v for k, v in r["curve_ms"].items()}
        cells = " | ".join(f"{c[k]:.1f} ({c[k] / c[1]:.2f})" for k in KS)
        print(f"| {r['weights']} | {cells} | {r['tok_s']:.1f} | {r['rss_mib']:.0f} |")
    if args.llama_server:
        print(f"\nllama-server peak RSS on the same GGUF (-c 2048, one answer): {llama_rss(args.llama_server):.0f} MiB")


if __name__ == "__main__":
    main()
