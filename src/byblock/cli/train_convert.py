"""`byblock train convert`: turn an autoregressive model into a block-diffusion one (AR → dLLM fine-tune).

    byblock train convert --model smollm2-135m --prompts train_prompts.jsonl --out runs/smollm2-dllm [--stage all]
    byblock train convert --model smollm2-135m --data runs/x/regen --out runs/smollm2-dllm  # reuse a DFlash regen

Stages: regenerate (the model answers the prompts: DFlash's stage, OUT/regen), train (OUT/convert: state.pt,
train.log; resumable: run the same command again), export (OUT/export-dllm: a transformers checkpoint plus
byblock_dllm.json, decoded by `byblock generate --model OUT/export-dllm` with any mask sampler).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

from byblock.models.registry import DEFAULT_MODEL

HELP = "convert an AR model into a block-diffusion LM (block-causal masked fine-tune)"
STAGES = ("regenerate", "train", "export", "all")


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock train convert`."""
    from byblock.cli.train import add_regen_args
    from byblock.training.convert import ConvertConfig

    parser.add_argument("--model", default=DEFAULT_MODEL, help="the autoregressive model to convert")
    parser.add_argument("--prompts", help="training prompts (JSONL with a 'prompt' field); never the eval sets")
    parser.add_argument("--data", help="a regen directory to train on (default: OUT/<--regen-dir>)")
    parser.add_argument("--out", required=True, help="work directory (regen/, convert/, export-dllm/)")
    parser.add_argument("--stage", default="all", choices=STAGES)
    add_regen_args(parser)
    t = parser.add_argument_group("convert")
    defaults = ConvertConfig()
    for f in fields(ConvertConfig):
        if f.name == "seed":
            continue
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            t.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=value, metavar="BOOL")
        else:
            t.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Run the requested stages in order; prints one JSON summary line."""
    from byblock.cli.train import _logging, regenerate_stage
    from byblock.errors import ByblockError
    from byblock.training.convert import ConvertConfig, Converter

    out = Path(args.out)
    _logging(out / "pipeline.log")
    cfg = ConvertConfig(**{f.name: getattr(args, f.name) for f in fields(ConvertConfig)})
    summary: dict = {}
    data = Path(args.data) if args.data else out / args.regen_dir
    if args.stage == "regenerate" or (args.stage == "all" and not (data / "manifest.json").is_file()):
        if args.data:
            raise ByblockError("--data names existing regen data; regenerate into OUT with --prompts instead")
        args.target, args.device = args.model, "cpu"  # the conversion itself runs on the CPU (issue 31)
        summary["regenerate"] = regenerate_stage(args, out)
    if args.stage in ("train", "export", "all"):
        if not (data / "manifest.json").is_file():
            raise ByblockError(f"no regen data in {data} (run --stage regenerate with --prompts, or pass --data)")
        conv = Converter(args.model, data, out / "convert", cfg)
        if args.stage == "export" and conv.step == 0:
            raise ByblockError(f"nothing trained yet in {out / 'convert'} (run --stage train first)")
        if args.stage != "export":
            summary["train"] = conv.run(progress=not args.quiet)
        if args.stage != "train":
            summary["export"] = str(conv.export(out / "export-dllm"))
    print(json.dumps(summary))
    return 0
