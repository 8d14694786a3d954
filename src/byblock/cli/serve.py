"""`byblock serve`: load a model and its drafters, serve the OpenAI API, /metrics and the playground."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from byblock.cli.dtype_args import add_dtype_args, load_target, resolve_placement
from byblock.errors import ByblockError
from byblock.models.registry import DEFAULT_MODEL


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock serve`."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, checkpoint dir, .gguf or hub id")
    parser.add_argument("--served-model-name", default=None, help="the id clients send as 'model' (default: --model)")
    add_dtype_args(parser)
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        help="a drafter to load (repeatable; the first is the default, 'none' is always loaded): "
        "ngram | model:ID | [adaptive-]dflash|ddtree|hybrid[:PATH] | domino|dominotree[:PATH]",
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per verify forward (see generate)")
    from byblock.cli import speculative_args

    speculative_args.add_arg(parser)
    parser.add_argument(
        "--tree-budget", type=int, default=31, help="max draft nodes per round (trees; 31 + root = one 32-row pass)"
    )
    parser.add_argument("--num-candidates", type=int, default=1, help="ngram: continuations merged into a tree")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="default max_tokens of chat requests (default: the rest of the context)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("BYBLOCK_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (default: $BYBLOCK_API_KEY)",
    )
    parser.add_argument("--max-tokens-limit", type=int, default=4096, help="larger max_tokens is a 400 error")
    parser.add_argument(
        "--engine",
        default="batched",
        choices=["batched", "fifo"],
        help="batched: continuous batching, many requests per forward (default; diffusion models where the model "
        "and sampler allow: mask models with the exact block cache); fifo: one request at a time",
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="batched: requests decoded together")
    parser.add_argument(
        "--max-queue", type=int, default=64, help="requests waiting beyond the running ones; more get a 503"
    )
    parser.add_argument(
        "--max-batched-tokens",
        type=int,
        default=2048,
        help="batched: rows per forward (longer prompts are chunked, or wait with --no-enable-chunked-prefill)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batched: prefill long prompts in chunks beside the decoding requests (default: where each request "
        "keeps its exact solo tokens: on in fp32, off with the bf16 row-invariant kernels)",
    )
    parser.add_argument(
        "--max-kv-tokens",
        type=int,
        default=None,
        help="batched: KV-cache slots of all running requests together; past it the newest is preempted "
        "(default: no limit)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--trust-remote-code", action="store_true", help="allow hub checkpoints to run code")
    from byblock.cli.generate_dllm import add_dllm_args
    from byblock.cli.sparse_args import add_sparse_args

    add_dllm_args(parser)
    add_sparse_args(parser)


def _check_port(host: str, port: int) -> None:
    """Fail with one line before loading anything if the address is taken."""
    if not 0 < port < 65536:
        raise ByblockError(f"--port must be in 1..65535, got {port}")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ByblockError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def run(args: argparse.Namespace) -> int:
    """Load, build the app, serve until interrupted."""
    from byblock.extras import require

    require("serve", "byblock serve")
    resolve_placement(args)
    from byblock.cli import speculative_args
    from byblock.server.app import ServerConfig, create_app

    speculative_args.apply_to_serve(args)

    if args.max_tokens is not None and not 1 <= args.max_tokens <= args.max_tokens_limit:
        raise ByblockError("need 1 <= --max-tokens <= --max-tokens-limit")
    if args.api_key is not None and not args.api_key.strip():
        raise ByblockError("--api-key must not be empty")
    if args.max_queue < 0:
        raise ByblockError("--max-queue must be >= 0")
    batch = _batch_config(args)
    _check_port(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="%(message)s", stream=sys.stderr)
    from byblock.dllm.loading import is_dllm_checkpoint

    if is_dllm_checkpoint(args.model):
        model, core, default = _dllm_core(args, batch)
    else:
        model, core, default = _ar_core(args, batch)
    from byblock.engine.core import FifoEngineCore

    running = 1 if isinstance(core, FifoEngineCore) else batch.max_num_seqs
    config = ServerConfig(
        model_name=args.served_model_name or args.model,
        default_drafter=default,
        default_max_tokens=args.max_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_pending=running + args.max_queue,
        api_key=args.api_key,
    )
    app = create_app(model, core, config, engine_thread=False)
    sys.stderr.write(
        f"byblock serve: {config.model_name} with drafters {', '.join(core.drafter_names)} "
        f"(default {default}), engine {type(core).__name__}, on http://{args.host}:{args.port}/  "
        "(playground at /, metrics at /metrics)\n"
    )
    _serve(app, args.host, args.port)
    return 0


def _serve(app, host: str, port: int) -> None:
    """HTTP on a thread, the engine loop on this (main) thread, until Ctrl-C or the HTTP server stops.

    The engine runs where the model was loaded: one OpenMP worker pool, which spins between parallel regions
    (server/worker.py AsyncEngine says why a second pool slows every forward)."""
    import signal
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    stop = threading.Event()

    def on_signal(signum, frame) -> None:  # also when the shell started us with SIGINT ignored (`serve &`)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    web = threading.Thread(target=server.run, name="byblock-http", daemon=True)
    web.start()
    try:
        app.state.engine.run(lambda: stop.is_set() or server.should_exit or not web.is_alive())
    finally:
        server.should_exit = True
        web.join(timeout=10)


def _dllm_core(args: argparse.Namespace, batch):
    """A diffusion model behind the same engine contract (the sampler flags set its decoding): batched where
    the model and sampler allow (engine/dllm_batched.py), else one request at a time."""
    from byblock.cli.generate_dllm import dllm_config
    from byblock.dllm.loading import load_dllm
    from byblock.engine.dllm_batched import DllmBatchedEngineCore, batchable, prepare_for_batching
    from byblock.engine.dllm_core import DllmEngineCore
    from byblock.models.adapter import TargetModel
    from byblock.models.loading import DTYPES

    if args.drafter:
        raise ByblockError("--drafter is for autoregressive models; diffusion models take --sampler")
    loaded = load_dllm(args.model, dtype=DTYPES[args.dtype], device=args.device)
    cfg = dllm_config(args, loaded, max_new_tokens=args.max_tokens or 512)
    tokenizing = TargetModel(loaded.denoiser.hf, loaded.tokenizer, name=args.model)  # the handlers' tokenizer view
    if args.engine == "batched" and batchable(loaded.denoiser, cfg):
        prepare_for_batching(loaded.denoiser)
        core = DllmBatchedEngineCore(loaded.denoiser, loaded.tokenizer, loaded.eos_token_ids, cfg, batch)
        return tokenizing, core, "none"
    return tokenizing, DllmEngineCore(loaded.denoiser, loaded.tokenizer, loaded.eos_token_ids, cfg), "none"


def _batch_config(args: argparse.Namespace):
    """The batched engine's limits (validated: a bad value is a one-line error)."""
    from byblock.engine.scheduler import BatchConfig

    return BatchConfig(
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        max_kv_tokens=args.max_kv_tokens,
        chunked_prefill=args.enable_chunked_prefill,
    )


def _ar_core(args: argparse.Namespace, batch):
    """An autoregressive model with its drafters, behind the batched or the FIFO engine."""
    from byblock.drafters import DrafterSpec, build_drafter
    from byblock.engine.batched import BatchedEngineCore
    from byblock.engine.core import SerialEngineCore

    knobs = {"block_size": args.block_size, "tree_budget": args.tree_budget, "num_candidates": args.num_candidates}
    knobs |= {k: getattr(args, k) for k in ("ngram_min", "ngram_max") if hasattr(args, k)}  # --speculative-config
    specs = {text: DrafterSpec.parse(text, **knobs) for text in dict.fromkeys(args.drafter)}
    model = load_target(args)
    from byblock.cli.sparse_args import enable_sparse

    enable_sparse(model, args)
    drafters = {text: build_drafter(spec, model, dtype=args.dtype) for text, spec in specs.items()}
    drafters.pop("none", None)
    default = args.drafter[0] if args.drafter else "none"
    if args.engine == "fifo" or not _batchable(model):
        return model, SerialEngineCore(model, drafters), default
    return model, BatchedEngineCore(model, drafters, batch), default


def _batchable(model) -> bool:
    """Whether packed forwards run on this model: byblock's attention kernels and plain KV caches (StreamingLLM,
    H2O, SnapKV and Stem decode one request at a time; the server then falls back to the FIFO engine)."""
    from byblock.kernels.gqa_sdpa import NAME as GQA
    from byblock.kernels.invariant import NAME as INVARIANT

    ok = model.hf.config._attn_implementation in (GQA, INVARIANT) and model.kv_window is None
    ok = ok and model.h2o is None and model.snapkv is None
    if not ok:
        logging.getLogger("byblock").warning(
            "warning: this model's attention or KV policy decodes one request at a time; using --engine fifo"
        )
    return ok
