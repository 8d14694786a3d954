"""`byblock recommend`: a short measured sweep on your prompts, ranked, with the commands for the winner."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from byblock.cli.dtype_args import add_dtype_args, load_target, resolve_placement
from byblock.errors import ByblockError
from byblock.models.registry import DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock recommend`."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    add_dtype_args(parser)
    parser.add_argument(
        "--prompts", default="dev", help="dev | humaneval | FILE.jsonl ({'prompt': ...} per line); a+b mixes them"
    )
    parser.add_argument("--limit", type=int, default=4, help="prompts measured (from each part of --prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--target", choices=["latency", "throughput"], default="latency", help="one request fast, or many at once"
    )
    parser.add_argument("--batch", type=int, default=8, help="throughput: requests decoded together")
    parser.add_argument("--methods", default=None, help="comma list of bench methods instead of the built-in sweep")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    """Sweep, rank, print."""
    resolve_placement(args)
    from byblock.dllm.loading import is_dllm_checkpoint

    if is_dllm_checkpoint(args.model):
        raise ByblockError("recommend sweeps autoregressive decoders; for a diffusion model run `byblock bench`")
    if args.limit < 1 or args.max_new_tokens < 1 or args.batch < 1:
        raise ByblockError("--limit, --max-new-tokens and --batch must be >= 1")
    from byblock.bench.methods import MethodRunner, MethodSpec
    from byblock.bench.recommend import candidates, commands, rank, table
    from byblock.bench.runner import run_dataset
    from byblock.cli.bench import load_datasets
    from byblock.sampling.params import SamplingParams

    names = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else candidates(args.target)
    if "ar" not in names:
        names.insert(0, "ar")
    specs = [MethodSpec.parse(n) for n in names]  # a typo is an error before anything loads
    prompts = [p for ps in load_datasets(args.prompts, None, args.limit).values() for p in ps]
    target = load_target(args)
    runners, skipped = {}, {}
    for spec in specs:
        try:
            runners[spec.name] = MethodRunner(spec, target, None, args.dtype)
        except ByblockError as e:  # e.g. no DFlash drafter ships for this model
            skipped[spec.name] = str(e)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    warm_ids = target.encode_prompt("Warm up: say hello.", chat=target.has_chat_template)
    for r in runners.values():
        r.run(warm_ids, SamplingParams(max_new_tokens=8))
    batch = args.batch if args.target == "throughput" else 1
    sys.stderr.write(f"byblock recommend: {len(runners)} methods x {len(prompts)} prompts, batch {batch} ...\n")
    totals = run_dataset(target, prompts, runners, params, reference="ar", batch=batch)
    base = totals["ar"]
    rows = {n: t.summary(base.tokens / base.seconds if base.seconds else None) for n, t in totals.items()}
    ranked = rank(rows)
    best = next((r for r in ranked if r.lossless), ranked[0])
    prompt_tokens = statistics.fmean(len(target.encode_prompt(p.text, chat=p.chat)) for p in prompts)
    notes = [f"skipped {n}: {why}" for n, why in skipped.items()]
    if prompt_tokens >= 4096:
        notes.append("long prompts: also try --sparse stem (prefill) and --kv-quant int8; not measured by this sweep")
    cmds = commands(best.method, args.model, batch)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "weights": target.weights,
                    "target": args.target,
                    "batch": batch,
                    "prompts": len(prompts),
                    "mean_prompt_tokens": round(prompt_tokens, 1),
                    "ranked": [r.__dict__ for r in ranked],
                    "best": best.method,
                    "commands": cmds,
                    "notes": notes,
                }
            )
        )
        return 0
    print(
        f"model {args.model} ({target.weights}), target {args.target}, batch {batch}, {len(prompts)} prompts "
        f"(mean {prompt_tokens:.0f} prompt tokens), {args.max_new_tokens} new tokens, greedy\n"
    )
    print(table(ranked))
    print(f"\nbest: {best.method} ({best.tok_s:.1f} tok/s, {best.speedup:.2f}x plain)")
    for what, cmd in cmds.items():
        print(f"  {what:8s} {cmd}")
    for note in notes:
        print(f"note: {note}")
    return 0
