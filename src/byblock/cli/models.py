"""`byblock models`: the built-in models, whether installed, whether de-quantized into the cache."""

from __future__ import annotations

import argparse
import json

from byblock.models.registry import BUILTIN_MODELS, DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock models`."""
    parser.add_argument("--json", action="store_true", help="print a JSON list")


def run(args: argparse.Namespace) -> int:
    """List built-ins."""
    rows = [
        {
            "name": m.name,
            "installed": m.installed(),
            "default": m.name == DEFAULT_MODEL,
            "description": m.description,
            "install": m.install_hint,
        }
        for m in BUILTIN_MODELS.values()
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        mark = "installed" if r["installed"] else f"missing ({r['install']})"
        default = " [default]" if r["default"] else ""
        print(f"{r['name']:<14} {mark:<42} {r['description']}{default}")
    return 0
