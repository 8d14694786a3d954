"""`byblock loadgen`: closed-loop load against a running server; throughput and TTFT p50/p99 per level.

byblock serve --drafter dflash &                      # in another terminal
byblock loadgen --drafters none,dflash --concurrency 1,4,16 --requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from byblock.errors import ByblockError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got '{text}'") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return vals


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock loadgen`."""
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    parser.add_argument("--drafters", default="none", help="comma list of drafters the server has loaded")
    parser.add_argument("--concurrency", type=_int_list, default=(1, 4, 16), help="comma list of client counts")
    parser.add_argument("--requests", type=int, default=16, help="requests per level")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds per level before no new requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--dataset",
        choices=("dev", "humaneval"),
        default="dev",
        help="dev: chat prompts to /v1/chat/completions; humaneval: HumanEval's raw code prompts to /v1/completions",
    )
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="dev prompts JSONL (default: $BYBLOCK_DEV_PROMPTS, else the 64 dev prompts shipped with byblock); "
        'rows with "chat": false go to /v1/completions',
    )
    parser.add_argument("--limit", type=int, default=32, help="distinct prompts used")
    parser.add_argument("--out", default=None, help="write load.json here")
    parser.add_argument("--update-results", default=None, help="RESULTS.md to update (with --section)")
    parser.add_argument("--section", default=None, help="section name inside --update-results")


def run(args: argparse.Namespace) -> int:
    """Run every level, print a table, optionally write JSON and a RESULTS.md section."""
    from byblock.extras import require

    require("serve", "byblock loadgen", ("httpx",))
    import httpx

    from byblock.bench.datasets import load_dev, load_humaneval
    from byblock.bench.load import LoadConfig, describe_prompts, markdown_table, prompt_texts, run_load
    from byblock.bench.report import replace_section

    if args.requests < 1 or args.max_tokens < 1 or args.duration <= 0:
        raise ByblockError("--requests and --max-tokens must be >= 1 and --duration > 0")
    if bool(args.update_results) != bool(args.section):
        raise ByblockError("--update-results and --section go together")
    if args.dataset == "humaneval" and args.dataset_path:
        raise ByblockError("--dataset humaneval takes no --dataset-path")
    rows = load_humaneval(args.limit) if args.dataset == "humaneval" else load_dev(args.limit, args.dataset_path)
    prompts, completions = prompt_texts(rows)
    try:
        models = httpx.get(f"{args.url}/v1/models", timeout=10).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise ByblockError(f"no OpenAI-compatible server at {args.url}: {type(e).__name__}") from None
    model = args.model or models[0]["id"]
    loaded = set((models[0].get("byblock") or {}).get("drafters", []))
    drafters = tuple(d for d in args.drafters.split(",") if d)
    missing = [d for d in drafters if loaded and d not in loaded]
    if missing:
        raise ByblockError(
            f"server has not loaded drafter(s) {', '.join(missing)} (loaded: {', '.join(sorted(loaded))})"
        )
    cfg = LoadConfig(
        url=args.url.rstrip("/"),
        model=model,
        prompts=prompts,
        drafters=drafters,
        concurrency=args.concurrency,
        requests=args.requests,
        duration_s=args.duration,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        completions=completions,
    )

    def progress(res) -> None:
        j = res.to_json()
        sys.stderr.write(
            f"[{j['drafter']} x{j['concurrency']}] {j['requests']} requests ({j['errors']} errors) "
            f"in {j['wall_s']:.1f}s: "
            f"{j['throughput_tok_s']:.1f} tok/s, TTFT p50 {j['ttft_p50_s']:.2f}s p99 {j['ttft_p99_s']:.2f}s\n"
        )

    results = run_load(cfg, progress)
    table = markdown_table(results, baseline=drafters[0])
    print(table, end="")
    command = "byblock loadgen " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["loadgen"] else sys.argv[1:])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "load.json").write_text(
            json.dumps({"command": command, "levels": [r.to_json() for r in results]}, indent=1)
        )
    if args.update_results:
        when = datetime.date.today().isoformat()
        body = (
            f"Measured {when}, `{command}` against `{cfg.url}` (model `{model}`), {cfg.max_tokens} max tokens, "
            f"temperature {cfg.temperature}, {describe_prompts(len(prompts), args.dataset, completions)}; TTFT "
            f"includes queueing.\n\n{table}"
        )
        replace_section(Path(args.update_results), args.section, body)
    return 0
