"""`byblock serve` as a real process: starts, answers the openai client, logs, stops cleanly on SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from serving import free_port

BYBLOCK = [sys.executable, "-m", "byblock.cli.main"]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


@pytest.mark.slow
def test_serve_cli_end_to_end(tiny_llama_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*BYBLOCK, "serve", "--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--drafter", "ngram"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        wait_healthy(url, proc)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0
        )
        assert out.usage.completion_tokens == 12 and out.model_dump()["byblock"]["drafter"] == "ngram"
        parts = list(
            c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0, stream=True
            )
        )
        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert text == out.choices[0].message.content
        assert "<html" in httpx.get(f"{url}/").text
        assert "byblock_tau" in httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "engine BatchedEngineCore" in err  # the default engine
    lines = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert [ln["stream"] for ln in lines if ln["event"] == "request"] == [False, True]
    assert "Traceback" not in err


def test_serve_bad_input_is_one_line(tiny_llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        bad = (
            ["--port", str(port)],
            ["--drafter", "eagle9"],
            ["--port", "70000"],
            ["--max-tokens", "0"],
            ["--max-num-seqs", "0"],
            ["--max-queue", "-1"],
            ["--max-kv-tokens", "0"],
            ["--drafter", "adaptive-ngram"],
        )
        for extra in bad:
            r = subprocess.run(
                [*BYBLOCK, "serve", "--model", str(tiny_llama_dir), *extra], capture_output=True, text=True
            )
            assert r.returncode == 2, (extra, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*BYBLOCK, "serve", "--model", "/nonexistent/model"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_serve_with_a_compressed_kv_cache(tiny_llama_dir):
    """The KV flags reach the server: H2O answers equal `byblock generate` with the same flags, with and
    without a drafter (speculative decoding stays lossless over the compressed cache)."""
    flags = ["--kv-h2o", "6", "--kv-h2o-recent", "4"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*BYBLOCK, "serve", "--model", str(tiny_llama_dir), "--served-model-name", "tiny", "--drafter", "ngram"]
    proc = subprocess.Popen(
        [*cmd, *flags, "--port", str(port)], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        wait_healthy(url, proc)
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
        texts = []
        for drafter in ("ngram", "none"):
            out = c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=24,
                temperature=0,
                extra_body={"drafter": drafter},
            )
            texts.append(out.choices[0].message.content)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    gen = subprocess.run(
        [*BYBLOCK, "generate", prompt, "--model", str(tiny_llama_dir), "--max-new-tokens", "24", "--json", *flags],
        capture_output=True,
        text=True,
    )
    assert gen.returncode == 0, gen.stderr
    assert texts[0] == texts[1] == json.loads(gen.stdout)["text"]
