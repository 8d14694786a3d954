"""`byblock bench --dataset passkey`: every long-prompt setting's retrieval accuracy next to its speed and memory.

    byblock bench --dataset passkey --settings dense,stem:0.75,int8,h2o:128+128 \
        --passkey-lengths 1024,2048,4096 --passkey-depths 0.1,0.5,0.9 --passkey-keys 1,3 [--methods ar,ngram]

Raw prompts (no chat template), greedy by default, --max-new-tokens (default 8 here) new tokens per answer.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys

from byblock.errors import ByblockError

DEFAULT_SETTINGS = "dense,stem:0.75,int8,int4,window:4+512,snapkv:256,h2o:128+128"


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags used only with --dataset passkey."""
    g = parser.add_argument_group("long-context probe (--dataset passkey)")
    g.add_argument(
        "--settings",
        default=DEFAULT_SETTINGS,
        help="comma list: dense | stem:S[/N] | decode:K[+W] | int8 | int4 | window:SINKS+WINDOW | snapkv:BUDGET | "
        "h2o:HEAVY+RECENT",
    )
    g.add_argument("--passkey-lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    g.add_argument("--passkey-depths", default="0.1,0.5,0.9", help="where the asked key sits (0 = start)")
    g.add_argument("--passkey-keys", default="1,3", help="keys hidden per prompt (>1: multi-key)")
    g.add_argument("--passkey-seeds", type=int, default=1, help="independent prompts per cell")


def _numbers(text: str, kind, flag: str) -> tuple:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ByblockError(f"{flag}: expected a comma list of numbers, got '{text}'") from None
    if not values:
        raise ByblockError(f"{flag} is empty")
    return values


def run(args: argparse.Namespace) -> int:
    """Load the model once per setting, run the grid, print/write the table and report.json."""
    from byblock.bench.longctx import LongSetting, PasskeyGrid, apply_setting, markdown, run_passkey
    from byblock.bench.methods import Engine, MethodRunner, MethodSpec
    from byblock.bench.report import write_table_report
    from byblock.cli.sparse_args import stem_config
    from byblock.models.loading import load_model
    from byblock.sampling.params import SamplingParams

    if args.dataset != "passkey":
        raise ByblockError("--dataset passkey runs on its own (its rows are settings, not datasets)")
    if bool(args.update_results) != bool(args.section):
        raise ByblockError("--update-results and --section go together")
    if (
        args.sparse != "none"
        or args.sparse_decode
        or args.kv_quant != "none"
        or args.kv_window
        or args.kv_snap
        or args.kv_h2o
    ):
        raise ByblockError("with --dataset passkey, choose long-prompt techniques with --settings")
    settings = [LongSetting.parse(s.strip()) for s in args.settings.split(",") if s.strip()]
    if not settings or len({s.name for s in settings}) != len(settings):
        raise ByblockError("--settings must list each setting once")
    grid = PasskeyGrid(
        _numbers(args.passkey_lengths, int, "--passkey-lengths"),
        _numbers(args.passkey_depths, float, "--passkey-depths"),
        _numbers(args.passkey_keys, int, "--passkey-keys"),
        args.passkey_seeds,
    )
    if min(grid.lengths) < 128 or not all(0 <= d <= 1 for d in grid.depths) or not all(1 <= k <= 8 for k in grid.keys):
        raise ByblockError("passkey lengths must be >= 128, depths in [0, 1], keys in 1..8")
    methods = "ar" if args.methods == "ar,ngram,dflash" else args.methods  # the bench default means "plain"
    specs = [MethodSpec.parse(m.strip()) for m in methods.split(",") if m.strip()]
    if any(s.engine is not Engine.BYBLOCK for s in specs):
        raise ByblockError("--dataset passkey runs byblock methods only (not hf / hf-lookup)")
    max_new = 8 if args.max_new_tokens == 128 else args.max_new_tokens
    params = SamplingParams(max_new_tokens=max_new, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    stem = stem_config(args, 0.0)  # each stem:S setting replaces the sparsity

    def progress(row: dict) -> None:
        if not args.quiet:
            sys.stderr.write(
                f"[{row['setting']} {row['method']} {row['length']}] {row['correct']}/{row['n']} correct, "
                f"TTFT {row['ttft_s']:.2f} s, KV {row['kv_mb']:.1f} MB\n"
            )

    rows = run_passkey(
        lambda: load_model(args.model, device=args.device, dtype=args.dtype),
        settings,
        lambda model, s: apply_setting(model, s, stem, args.kv_snap_window),
        lambda model: {s.name: MethodRunner(s, model, None, args.dtype) for s in specs},
        grid,
        params,
        progress,
    )
    command = "byblock bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    table = markdown(rows)
    report = {"command": command, "date": datetime.date.today().isoformat(), "model": args.model, "rows": rows}
    write_table_report(args.out, report, table, args.update_results, args.section)
    return 0
