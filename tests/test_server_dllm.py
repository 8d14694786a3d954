"""Diffusion models behind `byblock serve`: same API, block-by-block streaming, TPF as τ."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
from serving import free_port, running
from test_cli_serve import wait_healthy
from tiny import make_diffusion_gemma, make_tokenizer

from byblock.dllm import DllmConfig, SamplerKind
from byblock.dllm.denoisers import GemmaDenoiser
from byblock.dllm.generate import diffusion_generate
from byblock.engine.dllm_core import DllmEngineCore
from byblock.models.adapter import TargetModel
from byblock.server.app import ServerConfig, create_app


def test_diffusion_gemma_served_equals_library():
    hf = make_diffusion_gemma(canvas=8)
    tok = make_tokenizer(320)
    tok.chat_template = None
    den = GemmaDenoiser(hf)
    base = DllmConfig(sampler=SamplerKind.RENOISE, steps=5)
    core = DllmEngineCore(den, tok, frozenset({1}), base)
    app = create_app(TargetModel(hf, tok, name="dg"), core, ServerConfig(model_name="dg"))
    ids = tok("def add", add_special_tokens=True)["input_ids"]
    ref = diffusion_generate(den, ids, DllmConfig(sampler=SamplerKind.RENOISE, steps=5, max_new_tokens=20, seed=9), {1})
    with running(app) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        whole = c.completions.create(model="dg", prompt="def add", max_tokens=20, seed=9, temperature=0)
        parts = list(
            c.completions.create(model="dg", prompt="def add", max_tokens=20, seed=9, temperature=0, stream=True)
        )
    ext = whole.model_dump()["byblock"]
    assert whole.usage.completion_tokens == len(ref.token_ids)
    assert ext["drafter"] == "dllm-renoise" and ext["rounds"] == ref.nfe
    assert abs(ext["tau"] - ref.tpf) < 1e-3  # τ of a diffusion request is its tokens per forward
    text_chunks = [p.choices[0].text for p in parts if p.choices and p.choices[0].text]
    assert "".join(text_chunks) == whole.choices[0].text
    assert 1 <= len(text_chunks) <= len(ref.steps_per_block)  # streamed block by block


def test_serve_cli_with_a_diffusion_checkpoint(tmp_path):
    hf = make_diffusion_gemma(canvas=8)
    hf.save_pretrained(tmp_path)
    tok = make_tokenizer(320)
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "byblock.cli.main", "serve", "--model", str(tmp_path), "--served-model-name", "dg"]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--steps", "4"], stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = c.completions.create(model="dg", prompt="hello", max_tokens=12, seed=1)
        assert out.usage.completion_tokens >= 1 and out.model_dump()["byblock"]["drafter"] == "dllm-renoise"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert lines and lines[-1]["drafter"] == "none" and lines[-1]["status"] == "ok"
    bad = subprocess.run([*cmd, "--port", str(free_port()), "--sampler", "threshold"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_serve_batches_a_mask_model_and_each_answer_is_its_solo_run():
    """`byblock serve` runs the shipped mask model on the batched diffusion engine: concurrent clients share
    forwards (the batch-size gauge) and each answer equals the library's solo decode on the same kernels."""
    from concurrent.futures import ThreadPoolExecutor

    from byblock.dllm.loading import load_dllm
    from byblock.engine.dllm_batched import prepare_for_batching

    puzzles = ["100006040000000300010000002030060004", "053002602010030000000003015006000020"]
    puzzles += ["302050050060000306200000400000000004", "000000000000000000000000000000000000"]
    loaded = load_dllm("sudoku6-mdm")
    prepare_for_batching(loaded.denoiser)
    tok = loaded.tokenizer
    port = free_port()
    cmd = [sys.executable, "-m", "byblock.cli.main", "serve", "--model", "sudoku6-mdm", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--threshold", "0.7"], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def ask(p: str):
            return c.completions.create(model="sudoku6-mdm", prompt=p + "<sep>", max_tokens=36, temperature=0)

        with ThreadPoolExecutor(len(puzzles)) as pool:
            answers = list(pool.map(ask, puzzles))
        import urllib.request

        metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "DllmBatchedEngineCore" in err
    assert "byblock_batch_size" in metrics
    cfg = DllmConfig(sampler=SamplerKind.THRESHOLD, threshold=0.7, max_new_tokens=36)
    for p, got in zip(puzzles, answers, strict=True):
        ids = tok(p + "<sep>", add_special_tokens=True)["input_ids"]
        ref = diffusion_generate(loaded.denoiser, ids, cfg, loaded.eos_token_ids)
        assert got.choices[0].text == tok.decode(ref.token_ids, skip_special_tokens=True), p
        assert got.model_dump()["byblock"]["rounds"] == ref.nfe
