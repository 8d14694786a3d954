"""`byblock launch`: the engine commands (flags per device), their validation, the printed line."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import real_model_or_skip

from byblock.errors import ByblockError
from byblock.handoff.launch import LaunchConfig, llamacpp_command, vllm_command

CLI = [sys.executable, "-m", "byblock.cli.main", "launch"]


def _cfg(**kw) -> LaunchConfig:
    base = {"target": "/m", "draft": "/d", "block_size": 16, "served_name": "smollm2-135m", "python": "py"}
    return LaunchConfig(**{**base, **kw})


def test_vllm_command_per_device():
    cpu = vllm_command(_cfg())
    spec = json.loads(cpu.argv[cpu.argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
    assert "--enforce-eager" in cpu.argv and cpu.argv[cpu.argv.index("--dtype") + 1] == "float32"
    assert "VLLM_CPU_KVCACHE_SPACE" in cpu.env and "--gpu-memory-utilization" not in cpu.argv
    gpu = vllm_command(_cfg(cuda=True, tensor_parallel=2, extra=("--max-num-seqs", "8")))
    assert gpu.argv[gpu.argv.index("--dtype") + 1] == "bfloat16" and gpu.env == {}
    assert gpu.argv[gpu.argv.index("--gpu-memory-utilization") + 1] == "0.92"
    assert gpu.argv[gpu.argv.index("--tensor-parallel-size") + 1] == "2" and gpu.argv[-2:] == ("--max-num-seqs", "8")
    assert shlex.split(cpu.shell())[len(cpu.env) :] == list(cpu.argv)  # the printed line is the argv


def test_llamacpp_command():
    cmd = llamacpp_command(_cfg(draft="/d.gguf", target="/m.gguf", python="llama-server"))
    a = cmd.argv
    assert a[0] == "llama-server" and a[a.index("-m") + 1] == "/m.gguf" and a[a.index("-md") + 1] == "/d.gguf"
    assert a[a.index("--spec-type") + 1] == "draft-dflash" and a[a.index("--spec-draft-n-max") + 1] == "15"
    assert "-ngl" in llamacpp_command(_cfg(cuda=True)).argv


@pytest.mark.parametrize(
    "bad", [{"block_size": 1}, {"port": 0}, {"max_model_len": 4}, {"tensor_parallel": 2}, {"gpu_memory_utilization": 2}]
)
def test_launch_config_rejects_nonsense(bad):
    with pytest.raises(ByblockError):
        _cfg(**bad)


@pytest.mark.real_model
def test_launch_prints_the_command(tmp_path):
    real_model_or_skip()
    env = {**os.environ, "BYBLOCK_VLLM_PYTHON": str(tmp_path / "none")}  # printing needs no engine
    env.pop("BYBLOCK_LLAMA_SERVER", None)
    r = subprocess.run([*CLI, "vllm", "--port", "8123"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip())
    assert "vllm.entrypoints.openai.api_server" in argv and argv[argv.index("--port") + 1] == "8123"
    draft = json.loads(argv[argv.index("--speculative-config") + 1])["model"]
    assert sorted(p.name for p in Path(draft).iterdir()) == ["config.json", "model.safetensors"]
    r = subprocess.run([*CLI, "vllm", "--run"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "no vLLM interpreter" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*CLI, "llamacpp"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "--spec-type draft-dflash" in r.stdout, r.stderr
