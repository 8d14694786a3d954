"""The weights-dtype flags shared by `generate`, `bench` and `serve`."""

from __future__ import annotations

import argparse


def add_dtype_args(parser: argparse.ArgumentParser) -> None:
    """--dtype and --no-row-invariance."""
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights dtype")
    parser.add_argument(
        "--no-row-invariance",
        action="store_true",
        help="bf16: plain kernels instead of row-invariant ones (~10%% faster verify forwards, but speculative "
        "output may then differ from plain decoding at near-ties; models/invariant.py)",
    )


def row_invariant(args: argparse.Namespace) -> bool | None:
    """load_model's `row_invariant` for these flags (None: the dtype's default)."""
    return False if args.no_row_invariance else None
