"""Long-prompt flags shared by `generate`, `bench` and `serve`: Stem sparse prefill, KV-cache quantization."""

from __future__ import annotations

import argparse
import sys


def add_sparse_args(parser: argparse.ArgumentParser) -> None:
    """--sparse stem and its knobs."""
    s = parser.add_argument_group("long prompts (Stem sparse prefill, KV-cache compression and quantization)")
    s.add_argument("--kv-quant", default="none", choices=["none", "int8", "int4"], help="store the KV cache quantized")
    s.add_argument("--kv-window", type=int, default=0, help="StreamingLLM: keep the sinks + this many recent (0: off)")
    s.add_argument("--kv-sinks", type=int, default=4, help="StreamingLLM: first positions always kept")
    s.add_argument("--kv-snap", type=int, default=0, help="SnapKV: prompt positions kept per KV head (0: off)")
    s.add_argument("--kv-snap-window", type=int, default=64, help="SnapKV: observation window (last prompt tokens)")
    s.add_argument("--kv-h2o", type=int, default=0, help="H2O: heavy-hitter slots kept per KV head (0: off)")
    s.add_argument("--kv-h2o-recent", type=int, default=256, help="H2O: most recent slots kept per KV head")
    s.add_argument("--sparse", default="none", choices=["none", "stem"], help="sparse prefill for long prompts")
    s.add_argument("--sparsity", type=float, default=0.75, help="stem: fraction of key blocks skipped (> 0.85 warns)")
    s.add_argument("--tpd-decay", default="linear", choices=["linear", "exp"], help="stem: budget decay shape")
    s.add_argument("--tpd-alpha", type=float, default=0.7, help="stem: last query block's budget / base budget")
    s.add_argument("--oam-beta", type=float, default=0.5, help="stem: weight of the value-norm term")
    s.add_argument("--sparse-block", type=int, default=128, help="stem: block size (tokens)")
    s.add_argument("--sparse-min-tokens", type=int, default=2048, help="stem: shorter prompts stay dense")
    s.add_argument("--sparse-dense-layers", type=int, default=2, help="stem: the first layers stay dense")
    s.add_argument(
        "--sparse-share-layers",
        type=int,
        default=1,
        help="stem: choose the block index in one layer and reuse it in the next N-1 (1: per layer)",
    )
    s.add_argument(
        "--sparse-decode",
        type=int,
        default=0,
        metavar="K",
        help="decode/verify rows attend to the sinks, their recent keys and the K best key blocks (0: dense)",
    )
    s.add_argument(
        "--sparse-decode-window",
        type=int,
        default=256,
        help="sparse decode: recent positions every row sees densely (at least the rows of one verify)",
    )
    s.add_argument(
        "--sparse-decode-min-tokens",
        type=int,
        default=4096,
        help="sparse decode: rows at earlier positions attend densely (below ~4K selection costs more than it saves)",
    )
    s.add_argument("--sparse-backend", default="flex", choices=["flex", "gather"], help="stem: block-sparse kernel")


def stem_config(args: argparse.Namespace, sparsity: float):
    """The StemConfig the --sparse-* / --tpd-* / --oam-beta flags describe, at `sparsity`."""
    from byblock.attention.stem import Backend, Decay, StemConfig

    return StemConfig(
        sparsity=sparsity,
        decay=Decay(args.tpd_decay),
        alpha=args.tpd_alpha,
        oam_beta=args.oam_beta,
        block_size=args.sparse_block,
        min_tokens=args.sparse_min_tokens,
        dense_layers=args.sparse_dense_layers,
        backend=Backend(args.sparse_backend),
        share_layers=args.sparse_share_layers,
        prefill=args.sparse == "stem",
        decode_blocks=args.sparse_decode,
        decode_window=args.sparse_decode_window,
        decode_min_tokens=args.sparse_decode_min_tokens,
    )


def enable_sparse(model, args: argparse.Namespace):
    """Apply --kv-quant; switch the model to Stem prefill when --sparse stem and to sparse decode when
    --sparse-decode K (returns the density log, else None)."""
    from byblock.errors import ByblockError
    from byblock.kv.kv_cache import StreamingWindow

    model.kv_bits = {"none": None, "int8": 8, "int4": 4}[args.kv_quant]
    if args.kv_window < 0 or args.kv_sinks < 0:
        raise ByblockError("--kv-window and --kv-sinks must be >= 0")
    model.kv_window = StreamingWindow(args.kv_sinks, args.kv_window) if args.kv_window else None
    if args.kv_snap:
        from byblock.kv.snapkv import SnapKVConfig, enable_snapkv_on

        if args.sparse != "none" or model.kv_bits or model.kv_window:
            raise ByblockError("--kv-snap does not combine with --sparse, --kv-quant or --kv-window yet")
        try:
            enable_snapkv_on(model, SnapKVConfig(args.kv_snap, args.kv_snap_window))
        except ValueError as e:
            raise ByblockError(str(e)) from None
    if args.kv_h2o:
        from byblock.kv.h2o import H2OConfig, enable_h2o

        if args.sparse != "none" or model.kv_bits or model.kv_window or args.kv_snap:
            raise ByblockError("--kv-h2o does not combine with --sparse, --kv-quant, --kv-window or --kv-snap yet")
        try:
            model.h2o = enable_h2o(model.hf, H2OConfig(args.kv_h2o, args.kv_h2o_recent))
        except ValueError as e:
            raise ByblockError(str(e)) from None
    if args.sparse == "none" and not args.sparse_decode:
        return None
    if args.sparse_decode and (model.kv_window or args.kv_snap or args.kv_h2o):
        raise ByblockError("--sparse-decode does not combine with --kv-window, --kv-snap or --kv-h2o")
    from byblock.attention.hf_stem import enable_stem

    cfg = stem_config(args, args.sparsity)
    if cfg.sparsity > 0.85:
        sys.stderr.write(f"warning: --sparsity {cfg.sparsity} > 0.85: long-context retrieval quality usually drops\n")
    return enable_stem(model.hf, cfg)
