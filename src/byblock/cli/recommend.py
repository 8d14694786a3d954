"""`byblock recommend`: a short measured sweep on your prompts, ranked, with the commands for the winner."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from byblock.bench.recommend_long import LONG_PROMPT_TOKENS, long_flags
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
    parser.add_argument(
        "--long",
        choices=["auto", "on", "off"],
        default="auto",
        help="long-prompt sweep (Stem prefill, KV quantization / SnapKV) under the winner; auto: mean prompt >= 4096",
    )
    parser.add_argument(
        "--max-quality-drop",
        type=float,
        default=0.02,
        help="lossy options (diffusion samplers, long-prompt settings) qualify within this drop from the reference",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args: argparse.Namespace) -> int:
    """Sweep, rank, print."""
    resolve_placement(args)
    from byblock.dllm.loading import is_dllm_checkpoint

    if args.limit < 1 or args.max_new_tokens < 1 or args.batch < 1:
        raise ByblockError("--limit, --max-new-tokens and --batch must be >= 1")
    if not 0.0 <= args.max_quality_drop <= 1.0:
        raise ByblockError("--max-quality-drop must be in [0, 1]")
    if is_dllm_checkpoint(args.model):
        from byblock.cli.recommend_dllm import run_dllm

        return run_dllm(args)
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
    cmds = commands(best.method, args.model, batch)
    long = None
    if args.long == "on" or (args.long == "auto" and prompt_tokens >= LONG_PROMPT_TOKENS):
        long = _long_sweep(args, best.method, prompts, params)
        notes += [f"skipped {n}: {why}" for n, why in long["skipped"].items()]
        extra = " ".join(long_flags(long["best"]))
        if extra:
            cmds = {k: v + " " + extra if k != "launch" else v for k, v in cmds.items()}
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
                    "long": None if long is None else {k: v for k, v in long.items() if k != "table"},
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
    if long is not None:
        print(f"\nlong prompts, under {best.method} (quality budget: {args.max_quality_drop:.0%} of dense's tokens):\n")
        print(long["table"])
        print(f"\nbest long-prompt setting: {long['best']}")
    for what, cmd in cmds.items():
        print(f"  {what:8s} {cmd}")
    for note in notes:
        print(f"note: {note}")
    return 0


def _long_sweep(args: argparse.Namespace, method: str, prompts, params) -> dict:
    """The long-prompt settings under `method`, each on a freshly loaded model -> ranked rows and the winner."""
    from byblock.bench.methods import MethodRunner, MethodSpec
    from byblock.bench.recommend_long import long_candidates, long_table, rank_long, sweep_long

    loaded = [load_target(args)]  # the first load also encodes the prompts
    ids = [loaded[0].encode_prompt(p.text, chat=p.chat) for p in prompts]
    settings = long_candidates(statistics.fmean(len(i) for i in ids))
    spec = MethodSpec.parse(method)

    def load():
        return loaded.pop() if loaded else load_target(args)

    def progress(name: str, row: dict) -> None:
        sys.stderr.write(f"[long {name}] TTFT {row['ttft_s']:.3f} s, agreement {row['agreement']:.1%}\n")

    rows, skipped = sweep_long(load, lambda m: MethodRunner(spec, m, None, args.dtype), settings, ids, params, progress)
    ranked = rank_long(rows, args.max_quality_drop)
    return {
        "method": method,
        "ranked": [r.__dict__ for r in ranked],
        "best": ranked[0].setting,
        "skipped": skipped,
        "table": long_table(ranked),
    }
