"""`byblock train dflash`: regenerate → train → export a DFlash drafter for any HF target.

    byblock train dflash --target smollm2-135m --prompts train_prompts.jsonl --out runs/smollm2 [--stage all]

Work directory layout: OUT/regen (shards + manifest), OUT/train (state.pt, train.log), OUT/export (the
DFlash checkpoint). Every stage resumes where a killed run stopped; run the same command again.
Raw code-completion data (the HumanEval shape) in a second pass: `--stage code-prompts` writes
OUT/code_prompts.jsonl from the coding answers in OUT/regen (or OUT/<--regen-dir>); regenerate it with
`--regen-dir regen-code`;
train with `--extra-data OUT/regen-code`. `--stage source-prompts` writes OUT/source_prompts.jsonl: signature +
docstring prompts cut from the Python source on this machine (stdlib and installed packages, or --source-dirs).
Multi-process training: `torchrun --nproc_per_node=2 -m byblock.cli.main train dflash ... --stage train`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields
from enum import Enum
from pathlib import Path

from byblock.kernels.cpu_features import native_bf16
from byblock.models.registry import DEFAULT_MODEL


class Stage(Enum):
    """Pipeline stages, in order."""

    REGENERATE = "regenerate"
    CODE_PROMPTS = "code-prompts"  # not part of "all": raw code prompts from OUT/<regen-dir> for a 2nd pass
    SOURCE_PROMPTS = "source-prompts"  # not part of "all": raw code prompts from Python source on this machine
    TRAIN = "train"
    EXPORT = "export"
    ALL = "all"


def add_args(parser: argparse.ArgumentParser) -> None:
    """`byblock train METHOD`: one sub-parser per method (dflash and domino share their flags)."""
    from byblock.cli import train_dllm

    subs = parser.add_subparsers(dest="method", metavar="METHOD", required=True, parser_class=type(parser))
    for name, text in (("dflash", "the DFlash drafter"), ("domino", "a Domino correction head on a DFlash drafter")):
        add_dflash_args(subs.add_parser(name, help=text, description=text))
    train_dllm.add_args(subs.add_parser("dllm", help=train_dllm.HELP, description=train_dllm.HELP))
    from byblock.cli import train_eagle3

    train_eagle3.add_args(subs.add_parser("eagle3", help=train_eagle3.HELP, description=train_eagle3.HELP))
    from byblock.cli import train_convert

    train_convert.add_args(subs.add_parser("convert", help=train_convert.HELP, description=train_convert.HELP))


def add_dflash_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock train dflash|domino`."""
    from byblock.training.dflash_train import TrainConfig

    parser.add_argument("--target", default=DEFAULT_MODEL, help="the target model the drafter serves")
    parser.add_argument("--prompts", help="training prompts (JSONL with a 'prompt' field); never the eval sets")
    parser.add_argument("--out", required=True, help="work directory (regen/, train/, export/ inside)")
    parser.add_argument("--stage", default="all", choices=[s.value for s in Stage])
    parser.add_argument(
        "--device",
        default="auto",
        help="auto | cpu | cuda | cuda:N for regenerate and train (torchrun: one GPU per rank)",
    )
    add_regen_args(parser)
    t = parser.add_argument_group("train")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if f.name in ("seed", "domino"):
            continue
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if f.name == "bf16":  # autocast pays where bf16 is native (GPUs; CPUs with AVX512-BF16 / AMX); on other
            value = None  # CPUs emulated bf16 is ~3x slower than fp32. None: resolved for the device at run time
        if isinstance(value, bool) or f.name == "bf16":
            t.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value, metavar="BOOL")
        else:
            t.add_argument(flag, type=float if f.name in ("gamma",) else type(value), default=value)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def add_regen_args(parser: argparse.ArgumentParser) -> None:
    """The regenerate stage's flags (shared by every drafter trained on regenerated data)."""
    g = parser.add_argument_group("regenerate")
    g.add_argument("--features", type=int, default=5, help="target layers whose hidden states are fused")
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped")
    g.add_argument("--batch-size", type=int, default=64, help="sequences per shard (the unit of resumption)")
    g.add_argument(
        "--regen-rows",
        type=int,
        default=128,
        help="rows decoded together, refilled as answers end (may change on resume)",
    )
    g.add_argument("--topk", type=int, default=8, help="target log-probs kept per position (distillation)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy responses")
    g.add_argument("--limit", type=int, default=None, help="regenerate only this many prompts")
    g.add_argument(
        "--source-dirs",
        default=None,
        help="comma-separated source trees for --stage source-prompts (default: the stdlib and site-packages)",
    )
    g.add_argument("--regen-dir", default="regen", help="subdirectory of --out the regenerate stage writes")
    g.add_argument(
        "--regen-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target weights while regenerating (bfloat16: ~1.8x faster where the CPU has native bf16, ~3x slower "
        "where it does not)",
    )


def default_bf16(device) -> bool:
    """bf16 autocast by default where bf16 is native: CUDA, and CPUs with AVX512-BF16 / AMX."""
    return device.type == "cuda" or native_bf16()


def _logging(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    root = logging.getLogger("byblock")
    root.setLevel(logging.INFO)
    root.addHandler(handler)


def regenerate_stage(args: argparse.Namespace, out: Path) -> dict:
    """The regenerate stage into OUT/<--regen-dir> (resumes where a killed run stopped)."""
    from byblock.errors import ByblockError
    from byblock.models.loading import load_model_config
    from byblock.training.regenerate import RegenConfig, build_target_layer_ids, regenerate

    if not args.prompts:
        raise ByblockError("--prompts is required to regenerate")
    num_layers = load_model_config(args.target).get_text_config().num_hidden_layers
    cfg = RegenConfig(
        target=args.target,
        prompts=args.prompts,
        layer_ids=build_target_layer_ids(num_layers, args.features),
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        rows=args.regen_rows,
        topk=args.topk,
        temperature=args.temperature,
        seed=args.seed,
        limit=args.limit,
        dtype=args.regen_dtype,
    )
    return regenerate(cfg, out / args.regen_dir, progress=not args.quiet, device=args.device)


def run(args: argparse.Namespace) -> int:
    """Run the requested stages in order."""
    if args.method == "dllm":
        from byblock.cli import train_dllm

        return train_dllm.run(args)
    if args.method == "eagle3":
        from byblock.cli import train_eagle3

        return train_eagle3.run(args)
    if args.method == "convert":
        from byblock.cli import train_convert

        return train_convert.run(args)
    from byblock.errors import ByblockError
    from byblock.models.devices import resolve_device
    from byblock.training.dflash_train import TrainConfig

    args.device = resolve_device(args.device)  # a one-line error for a device this machine lacks
    stage = Stage(args.stage)
    out = Path(args.out)
    _logging(out / "pipeline.log")
    summary: dict = {}
    if stage in (Stage.REGENERATE, Stage.ALL) and args.method == "dflash":
        summary["regenerate"] = regenerate_stage(args, out)
    if stage is Stage.CODE_PROMPTS:
        if not args.prompts:
            raise ByblockError("--prompts (the file OUT/<regen-dir> was regenerated from) is required for code-prompts")
        from byblock.models.loading import load_tokenizer
        from byblock.training.code_prompts import derive_from_regen, write_jsonl

        tokenizer = load_tokenizer(args.target)
        derived = derive_from_regen(out / args.regen_dir, args.prompts, tokenizer)
        summary["code_prompts"] = {"path": str(write_jsonl(derived, out / "code_prompts.jsonl")), "n": len(derived)}
    if stage is Stage.SOURCE_PROMPTS:
        from byblock.training.code_prompts import write_jsonl
        from byblock.training.source_prompts import collect, default_roots

        roots = [Path(d) for d in args.source_dirs.split(",")] if args.source_dirs else default_roots()
        missing = [str(r) for r in roots if not r.is_dir()]
        if missing:
            raise ByblockError(f"--source-dirs: not a directory: {', '.join(missing)}")
        found = collect(roots, seed=args.seed)
        if not found:
            raise ByblockError(f"no documented public functions under {', '.join(map(str, roots))}")
        summary["source_prompts"] = {"path": str(write_jsonl(found, out / "source_prompts.jsonl")), "n": len(found)}
    if stage in (Stage.TRAIN, Stage.EXPORT, Stage.ALL):
        from byblock.training.dflash_train import DFlashTrainer

        values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name != "domino"}
        if values["bf16"] is None:
            values["bf16"] = default_bf16(args.device)
        if values["gamma"] is not None:
            values["gamma"] = float(values["gamma"])
        domino = args.method == "domino"
        if domino and not values["init_from"]:
            values["init_from"] = str(out / "export")  # the DFlash drafter this work dir trained
        if domino and not Path(values["init_from"], "config.json").is_file():
            raise ByblockError(f"Domino starts from a DFlash checkpoint; none at {values['init_from']}")
        tcfg = TrainConfig(**values, domino=domino)
        suffix = "-domino" if domino else ""
        trainer = DFlashTrainer(args.target, out / "regen", out / f"train{suffix}", tcfg, device=args.device)
        if stage is Stage.EXPORT and trainer.step == 0:
            raise ByblockError(f"nothing trained yet in {out / f'train{suffix}'} (run --stage train first)")
        if stage is not Stage.EXPORT:
            summary["train"] = trainer.run(progress=not args.quiet)
        if trainer.rank == 0 and stage is not Stage.TRAIN:
            summary["export"] = str(trainer.export(out / f"export{suffix}"))
    sys.stderr.write(f"{summary}\n")
    return 0
