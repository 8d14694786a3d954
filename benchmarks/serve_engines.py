"""FIFO vs batched engine under load (RESULTS.md §serve): two `byblock serve` processes, same model and drafters,
one per engine; `byblock loadgen`'s closed-loop clients at each concurrency level, engines interleaved per level
(machine drift hits both alike). Prints one table and, with --update-results, writes it into RESULTS.md.

    .venv/bin/python benchmarks/serve_engines.py --drafters none,adaptive-hybrid,adaptive-dflash \
        --concurrency 1,4,16 --update-results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from byblock.bench.datasets import load_dev, load_humaneval
from byblock.bench.hardware import describe_machine
from byblock.bench.load import LoadConfig, describe_prompts, prompt_texts, run_level
from byblock.bench.report import replace_section

ROOT = Path(__file__).resolve().parents[1]
BYBLOCK = os.environ.get("BYBLOCK", str(ROOT / ".venv" / "bin" / "byblock"))


def free_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, drafters: list[str], extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`byblock serve --engine ENGINE` on a free port; returns (process, base URL) once /health answers."""
    port = free_port()
    cmd = [BYBLOCK, "serve", "--port", str(port), "--engine", engine, "--log-level", "warning", *extra]
    for d in drafters:
        if d != "none":
            cmd += ["--drafter", d]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"serve --engine {engine} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"serve --engine {engine} did not come up")


def main() -> int:
    """Run the levels, print and record the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafters", default="none,adaptive-hybrid")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per level = clients × this (min 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=32, help="distinct prompts")
    p.add_argument(
        "--dataset", choices=("dev", "humaneval"), default="dev", help="humaneval: raw code prompts to /v1/completions"
    )
    p.add_argument("--out", default="bench-out/serve-engines")
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default="serve-engines")
    p.add_argument("serve_args", nargs="*", help="extra `byblock serve` flags (after --)")
    args = p.parse_args()
    drafters = [d for d in args.drafters.split(",") if d]
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = load_humaneval(args.limit) if args.dataset == "humaneval" else load_dev(args.limit)
    prompts, completions = prompt_texts(rows)
    servers = {engine: start(engine, drafters, args.serve_args) for engine in ("fifo", "batched")}
    rows = []
    try:
        model = httpx.get(f"{servers['fifo'][1]}/v1/models").json()["data"][0]["id"]
        for c in levels:
            for d in drafters:
                for engine, (_, url) in servers.items():
                    cfg = LoadConfig(
                        url=url,
                        model=model,
                        prompts=prompts,
                        drafters=(d,),
                        concurrency=(c,),
                        requests=max(8, c * args.requests_per_client),
                        max_tokens=args.max_tokens,
                        completions=completions,
                    )
                    res = asyncio.run(run_level(cfg, d, c))
                    j = res.to_json() | {"engine": engine}
                    rows.append(j)
                    tail = f"TTFT p50 {j['ttft_p50_s']:.2f}s p99 {j['ttft_p99_s']:.2f}s"
                    head = f"[{engine} {d} x{c}] {j['requests']} req ({j['errors']} err)"
                    sys.stderr.write(f"{head} {j['throughput_tok_s']:.1f} tok/s {tail}\n")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    fifo = {(r["drafter"], r["concurrency"]): r["throughput_tok_s"] for r in rows if r["engine"] == "fifo"}
    plain = {(r["engine"], r["concurrency"]): r["throughput_tok_s"] for r in rows if r["drafter"] == "none"}
    lines = [
        "| engine | drafter | clients | requests (errors) | tok/s | vs FIFO | vs plain | TTFT p50 s | TTFT p99 s | "
        "latency p50 s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        key = (r["drafter"], r["concurrency"])
        vs_fifo = r["throughput_tok_s"] / fifo[key] if fifo.get(key) else float("nan")
        base = plain.get((r["engine"], r["concurrency"]))
        vs_plain = r["throughput_tok_s"] / base if base else float("nan")
        lines.append(
            f"| {r['engine']} | {r['drafter']} | {r['concurrency']} | {r['requests']} ({r['errors']}) | "
            f"{r['throughput_tok_s']:.1f} | {vs_fifo:.2f}× | {vs_plain:.2f}× | {r['ttft_p50_s']:.2f} | "
            f"{r['ttft_p99_s']:.2f} | {r['e2e_p50_s']:.2f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table, end="")
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/serve_engines.py " + shlex.join(sys.argv[1:])
    (out / "load.json").write_text(json.dumps({"command": command, "levels": rows}, indent=1))
    if args.update_results:
        body = (
            f"Measured {datetime.date.today().isoformat()} on {describe_machine()}: `{command}`; model `{model}`, "
            f"{args.max_tokens} max tokens, greedy, {describe_prompts(len(prompts), args.dataset, completions)}, "
            "closed-loop streamed clients; "
            "TTFT and latency include queueing.\n\n" + table
        )
        replace_section(Path(args.update_results), args.section, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
