"""`byblock export`: write a drafter in the layout a serving engine loads as is.

byblock export --drafter dflash --format vllm --out exports/smollm2-dflash-vllm
byblock export --drafter dflash:runs/x/export --target runs/target --format vllm --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from byblock.models.registry import DEFAULT_MODEL

FORMATS = ("vllm", "llamacpp")  # SGLang: see docs/handoff.md


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock export`."""
    parser.add_argument(
        "--drafter", default="dflash", help="dflash|eagle3[:PATH] (default: the drafter shipped for --target)"
    )
    parser.add_argument("--target", default=DEFAULT_MODEL, help="the target model the drafter serves")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the engine whose layout to write")
    parser.add_argument("--out", required=True, help="output directory (llamacpp: a .gguf file or a directory)")
    parser.add_argument("--target-gguf", default=None, help="llamacpp: the target's GGUF (default: a built-in's own)")


def run(args: argparse.Namespace) -> int:
    """Write the engine's layout, print how to serve it, end stdout with one JSON line."""
    from byblock.handoff.export import EngineFormat, export_drafter

    done = export_drafter(args.drafter, args.target, EngineFormat(args.format), Path(args.out), args.target_gguf)
    k = done.block_size - 1
    speculative = {"method": done.method, "model": str(done.out.resolve()), "num_speculative_tokens": k}
    sys.stderr.write(f"byblock export: wrote {done.out} ({args.format}); serve it with\n")
    sys.stderr.write(f"  byblock launch {args.format} --target {args.target} --exported {done.out} --run\n")
    line = {"out": str(done.out), "format": args.format, "target": done.target, "speculative_config": speculative}
    print(json.dumps(line))
    return 0
