"""`byblock train eagle3`: regenerate → train → export an EAGLE-3 head, on the DFlash pipeline's data.

    byblock train eagle3 --target smollm2-135m --prompts train_prompts.jsonl --out runs/smollm2 [--stage all]

The regenerate stage is DFlash's (OUT/regen: the target's answers and hidden states); without --prompts, `all`
trains on the regen a DFlash run left in OUT, so both drafters train on the same data. The head reads the three
stored feature layers nearest vLLM's defaults. Train state in OUT/train-eagle3 (resumable: run the same
command again), the checkpoint in OUT/export-eagle3 (vLLM's `LlamaForCausalLMEagle3` layout).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from byblock.models.registry import DEFAULT_MODEL

HELP = "an EAGLE-3 head (training-time test) on regenerated data"
STAGES = ("regenerate", "train", "export", "all")


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock train eagle3`."""
    from byblock.cli.train import add_regen_args
    from byblock.training.eagle3_train import Eagle3TrainConfig

    parser.add_argument("--target", default=DEFAULT_MODEL, help="the target model the head serves")
    parser.add_argument("--prompts", help="training prompts (JSONL with a 'prompt' field); never the eval sets")
    parser.add_argument("--out", required=True, help="work directory (regen/, train-eagle3/, export-eagle3/)")
    parser.add_argument("--stage", default="all", choices=STAGES)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_regen_args(parser)
    t = parser.add_argument_group("train")
    defaults = Eagle3TrainConfig()
    for f in fields(Eagle3TrainConfig):
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
    """Run the requested stages in order."""
    from byblock.cli.train import _logging, regenerate_stage
    from byblock.errors import ByblockError
    from byblock.models.devices import resolve_device
    from byblock.training.eagle3_train import Eagle3TrainConfig, Eagle3Trainer

    args.device = resolve_device(args.device)
    out = Path(args.out)
    _logging(out / "pipeline.log")
    cfg = Eagle3TrainConfig(**{f.name: getattr(args, f.name) for f in fields(Eagle3TrainConfig)})
    summary: dict = {}
    data = out / args.regen_dir
    if (args.stage in ("regenerate", "all") and not (data / "manifest.json").is_file()) or args.stage == "regenerate":
        summary["regenerate"] = regenerate_stage(args, out)
    if args.stage in ("train", "export", "all"):
        trainer = Eagle3Trainer(args.target, data, out / "train-eagle3", cfg, device=args.device)
        if args.stage == "export" and trainer.step == 0:
            raise ByblockError(f"nothing trained yet in {out / 'train-eagle3'} (run --stage train first)")
        if args.stage != "export":
            summary["train"] = trainer.run(progress=not args.quiet)
        if args.stage != "train":
            summary["export"] = str(trainer.export(out / "export-eagle3"))
    sys.stderr.write(f"{summary}\n")
    return 0
