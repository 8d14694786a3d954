"""`byblock models`: the built-in models, whether installed, whether de-quantized into the cache."""

from __future__ import annotations

import argparse
import json

from byblock.models.registry import BUILTIN_MODELS, DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock models`."""
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    parser.add_argument(
        "--prune-cache",
        action="store_true",
        help="delete cached model conversions other than the installed built-ins' current ones "
        "(any other is converted again on its next load)",
    )


def run(args: argparse.Namespace) -> int:
    """List built-ins (or prune the conversion cache)."""
    if args.prune_cache:
        from byblock.models.loading import prune_model_cache

        gone, freed = prune_model_cache()
        if args.json:
            print(json.dumps({"deleted": [str(p) for p in gone], "freed_bytes": freed}))
        else:
            print(f"deleted {len(gone)} cached conversions, {freed / 2**30:.2f} GiB freed")
        return 0
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
