"""`byblock train dllm`: generate Sudoku puzzles, train a masked-diffusion model and an AR model of the
same size and budget on them, export both.

    byblock train dllm --out runs/sudoku6 --kind both --steps 4000

Layout: OUT/data (puzzles), OUT/mdm and OUT/ar (state.pt, train.log), OUT/export-mdm, OUT/export-ar.
Every stage resumes after a kill: run the same command again.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

HELP = "a masked-diffusion model and an AR model of the same size on generated Sudoku"


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock train dllm`."""
    from byblock.training.dllm_train import DllmTrainConfig, PuzzleConfig

    parser.add_argument("--out", required=True, help="work directory")
    parser.add_argument("--stage", default="all", choices=["generate", "train", "export", "all"])
    parser.add_argument("--kind", default="both", choices=["mdm", "ar", "both"], help="which model(s) to train")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    for group_name, cls in (("puzzles", PuzzleConfig), ("model and training", DllmTrainConfig)):
        g = parser.add_argument_group(group_name)
        defaults = cls()
        for f in fields(cls):
            if f.name in ("kind", "seed") and cls is DllmTrainConfig:
                continue
            g.add_argument(
                "--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name)
            )


def run(args: argparse.Namespace) -> int:
    """Generate, train (one or both kinds), export."""
    import torch

    from byblock.errors import ByblockError
    from byblock.training.dllm_train import DllmTrainConfig, DllmTrainer, PuzzleConfig, generate_puzzles

    pcfg = PuzzleConfig(**{f.name: getattr(args, f.name) for f in fields(PuzzleConfig)})
    if pcfg.box_rows < 1 or pcfg.box_cols < 1 or pcfg.board.n > 9:
        raise ByblockError("boards from 1x1 boxes up to 9x9 (box rows x cols <= 9)")
    if pcfg.train_puzzles < 1 or pcfg.test_puzzles < 1:
        raise ByblockError("--train-puzzles and --test-puzzles must be >= 1")
    out = Path(args.out)
    summary: dict = {}
    if args.stage in ("generate", "all"):
        train_path, test_path = generate_puzzles(out, pcfg, progress=not args.quiet)
        summary["puzzles"] = {"train": str(train_path), "test": str(test_path)}
    if args.stage in ("train", "export", "all"):
        if args.stage != "export" and torch.get_num_threads() > 1 and args.kind == "both":
            sys.stderr.write(
                "note: training mdm then ar in one process; run --kind mdm and --kind ar apart to overlap\n"
            )
        for kind in ("mdm", "ar") if args.kind == "both" else (args.kind,):
            values = {f.name: getattr(args, f.name) for f in fields(DllmTrainConfig) if f.name not in ("kind", "seed")}
            trainer = DllmTrainer(out, pcfg, DllmTrainConfig(kind=kind, seed=pcfg.seed, **values))
            if args.stage == "export":
                if trainer.step == 0:
                    raise ByblockError(f"nothing trained yet in {trainer.dir}")
                summary[kind] = {"export": str(trainer.export())}
            else:
                summary[kind] = trainer.run(progress=not args.quiet)
    print(json.dumps(summary))
    return 0
