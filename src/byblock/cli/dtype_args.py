"""The device, weights-dtype and kernel flags shared by `generate`, `bench` and `serve`."""

from __future__ import annotations

import argparse


def add_dtype_args(parser: argparse.ArgumentParser) -> None:
    """--device, --dtype, --weights, --activations, --linears and --no-row-invariance."""
    parser.add_argument(
        "--device", default="auto", help="auto | cpu | cuda | cuda:N (auto: CUDA when a GPU is visible, else the CPU)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="weights dtype (auto: bfloat16 on CUDA, float32 on the CPU)",
    )
    parser.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "fp32", "bf16", "int8", "int4", "gguf"],
        help="how linears hold their weights (auto: a GGUF's own Q4_0/Q4_1/Q4_K/Q8_0 blocks on the CPU, else "
        "the --dtype's floats; int8/int4: round-to-nearest groups of 32; all quantized kernels are CPU ones, "
        "row-invariant: kernels/quant_gemm.py)",
    )
    parser.add_argument(
        "--activations",
        default="int8",
        choices=["int8", "fp32"],
        help="quantized weights' inputs: int8 (quantized per row and group of 32, integer dot products: "
        "fastest) or fp32 (the weights converted to float: closest to the float model); both row-invariant",
    )
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


def resolve_placement(args: argparse.Namespace) -> None:
    """Resolve --device and --dtype once, before anything loads: `args.device` becomes a torch.device and
    `args.dtype` a concrete name ("float32" / "bfloat16"); a device this machine lacks is a one-line error."""
    from byblock.models.devices import resolve_device, resolve_dtype, weights_dtype

    args.dtype = weights_dtype(args.weights, args.dtype)
    args.device = resolve_device(args.device)
    args.dtype = {"torch.float32": "float32", "torch.bfloat16": "bfloat16"}[str(resolve_dtype(args.dtype, args.device))]


def relayout(args: argparse.Namespace) -> bool | str:
    """load_model's `relayout` for --linears."""
    return {"auto": True, "packed": "packed", "library": "inout"}[args.linears]


def load_target(args: argparse.Namespace):
    """The target model these flags name (--model, --device, --dtype, --weights, row invariance, relayout)."""
    from byblock.models.loading import load_model

    return load_model(
        args.model,
        device=args.device,
        dtype=args.dtype,
        trust_remote_code=getattr(args, "trust_remote_code", False),
        row_invariant=row_invariant(args),
        relayout=relayout(args),
        weights=args.weights,
        activations=args.activations,
    )
