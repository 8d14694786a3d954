"""`byblock launch`: start a production engine's OpenAI server with byblock's drafter, in one command.

    byblock launch vllm                          # print the command (exports the shipped drafter first)
    byblock launch vllm --run                    # ...and start it (vLLM from --python / $BYBLOCK_VLLM_PYTHON)
    byblock launch vllm --exported DIR --port 8001 --run -- --max-num-seqs 32
    byblock launch llamacpp --llama-server ~/llama.cpp/build/bin/llama-server --run

Prints the command line on stdout; with --run the engine replaces this process (signals reach it directly).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from byblock.models.registry import DEFAULT_MODEL

ENGINES = ("vllm", "llamacpp")


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock launch`."""
    parser.add_argument("engine", choices=ENGINES, help="the engine to start")
    parser.add_argument("--target", default=DEFAULT_MODEL, help="the target model (a built-in name or a path)")
    parser.add_argument("--drafter", default="dflash", help="dflash|eagle3[:PATH], exported before the start")
    parser.add_argument("--exported", default=None, help="an already exported drafter (byblock export)")
    parser.add_argument("--target-gguf", default=None, help="llamacpp: the target's GGUF (default: a built-in's own)")
    parser.add_argument("--llama-server", default=None, help="llamacpp: the binary (default $BYBLOCK_LLAMA_SERVER)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA when visible")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the target's, at most 8192")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--cpu-kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE on a CPU")
    parser.add_argument(
        "--python", default=None, help="the engine's interpreter (default $BYBLOCK_VLLM_PYTHON, else ./.venv-vllm)"
    )
    parser.add_argument("--run", action="store_true", help="start the server instead of only printing the command")
    parser.add_argument("extra", nargs="*", help="after --: flags passed to the engine as they are")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text.strip("/")).strip("-")[-60:] or "model"


def _exported_block_size(draft: Path, llamacpp: bool) -> tuple[int, str]:
    """The block size and method an exported drafter declares (config.json for vLLM, GGUF metadata for llama.cpp)."""
    from byblock.errors import ByblockError

    if llamacpp:
        if draft.suffix != ".gguf" or not draft.is_file():
            raise ByblockError(f"--exported {draft}: not a GGUF file (make it with byblock export --format llamacpp)")
        from gguf import GGUFReader

        from byblock.handoff.llamacpp import BLOCK_KEY

        fields = GGUFReader(str(draft)).fields
        arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
        key = {"dflash": "dflash.block_size", "eagle3": BLOCK_KEY}.get(arch)
        if key is None or key not in fields:
            raise ByblockError(f"--exported {draft}: not a GGUF byblock exported (arch {arch}, no block size)")
        return int(fields[key].contents()), arch
    if not (draft / "config.json").is_file():
        raise ByblockError(f"--exported {draft}: no config.json (make it with byblock export --format vllm)")
    return int(json.loads((draft / "config.json").read_text()).get("block_size", 16)), "dflash"


def _engine_binary(args: argparse.Namespace, llamacpp: bool) -> str:
    """The interpreter (vLLM) or binary (llama-server); when only printing, a plain name if none is found."""
    from byblock.errors import ByblockError
    from byblock.handoff.llamacpp_peer import find_llama_server
    from byblock.handoff.vllm_peer import find_vllm_python

    try:
        return str(find_llama_server(args.llama_server) if llamacpp else find_vllm_python(args.python))
    except ByblockError:
        if args.run:
            raise
        return (args.llama_server or "llama-server") if llamacpp else (args.python or "python")


def run(args: argparse.Namespace) -> int:
    """Export (unless --exported), build the engine's command, print it, exec it with --run."""
    from byblock.handoff.export import EngineFormat, export_drafter, target_gguf_of
    from byblock.handoff.launch import LaunchConfig, llamacpp_command, vllm_command
    from byblock.models.loading import cache_root, resolve_checkpoint

    llamacpp = args.engine == "llamacpp"
    method = "dflash"
    if args.exported:
        from byblock.drafters.eagle3_format import is_eagle3_checkpoint

        draft = Path(args.exported).expanduser()
        if is_eagle3_checkpoint(draft):
            method = "eagle3"
            extra = json.loads((draft / "config.json").read_text()).get("byblock") or {}
            block = int(extra.get("num_speculative_tokens", 7)) + 1
        else:
            block, method = _exported_block_size(draft, llamacpp)
        target = str(target_gguf_of(args.target, args.target_gguf)) if llamacpp else resolve_checkpoint(args.target)
    else:
        out = cache_root() / "exports" / f"{_slug(args.target)}-{_slug(args.drafter)}-{args.engine}"
        done = export_drafter(args.drafter, args.target, EngineFormat(args.engine), out, args.target_gguf)
        draft, block, target, method = done.out, done.block_size, done.target, done.method
    cuda = args.device == "cuda"
    if args.device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    max_len = args.max_model_len
    if max_len is None:
        from byblock.models.loading import load_model_config

        config = load_model_config(args.target)
        max_len = min(int(getattr(config, "max_position_embeddings", 8192) or 8192), 8192)
    python = _engine_binary(args, llamacpp)
    cfg = LaunchConfig(
        target=target,
        draft=str(Path(draft).absolute()),
        block_size=block,
        served_name=args.target if "/" not in args.target else Path(args.target).name,
        cuda=cuda,
        dtype=args.dtype,
        max_model_len=max_len,
        host=args.host,
        port=args.port,
        tensor_parallel=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        python=python,
        extra=tuple(args.extra),
        method=method,
    )
    cmd = llamacpp_command(cfg) if llamacpp else vllm_command(cfg)
    print(cmd.shell(), flush=True)
    if not args.run:
        return 0
    sys.stderr.write(f"byblock launch: starting {args.engine} on http://{args.host}:{args.port}/v1\n")
    env = {**os.environ, **cmd.env, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    for var in ("PYTHONPATH", "VIRTUAL_ENV"):  # byblock's venv must not leak into the engine's
        env.pop(var, None)
    os.execve(cmd.argv[0], list(cmd.argv), env)
    return 0  # not reached
