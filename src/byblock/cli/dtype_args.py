"""The weights-dtype and kernel flags shared by `generate`, `bench` and `serve`."""

from __future__ import annotations

import argparse


def add_dtype_args(parser: argparse.ArgumentParser) -> None:
    """--dtype, --linears and --no-row-invariance."""
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights dtype")
    parser.add_argument(
        "--linears",
        default="auto",
        choices=["auto", "packed", "library"],
        help="fp32 linear kernels: byblock's packed GEMM (compiled on first use; fast at any row count and "
        "row-invariant), PyTorch's library kernels, or auto (packed where it builds; kernels/packed_gemm.py)",
    )
    parser.add_argument(
        "--no-row-invariance",
        action="store_true",
        help="bf16: plain kernels instead of row-invariant ones (~10%% faster verify forwards, but speculative "
        "output may then differ from plain decoding at near-ties; kernels/invariant.py)",
    )


def row_invariant(args: argparse.Namespace) -> bool | None:
    """load_model's `row_invariant` for these flags (None: the dtype's default)."""
    return False if args.no_row_invariance else None


def relayout(args: argparse.Namespace) -> bool | str:
    """load_model's `relayout` for --linears."""
    return {"auto": True, "packed": "packed", "library": "inout"}[args.linears]
