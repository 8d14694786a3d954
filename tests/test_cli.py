"""The real `byblock` CLI, driven as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def byblock(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    # A closed local port stands in for an unreachable hub: hub ids must fail fast, in one line.
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "byblock.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_generate_json_schema(tiny_llama_dir):
    r = byblock("generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1  # exactly one JSON object on stdout
    obj = json.loads(lines[0])
    for key, typ in {
        "text": str,
        "token_ids": list,
        "num_new_tokens": int,
        "ttft_s": float,
        "tokens_per_s": float,
        "drafter": str,
        "block_size": int,
        "rounds": int,
        "mean_accepted": float,
        "acceptance_histogram": list,
    }.items():
        assert isinstance(obj[key], typ), key
    assert obj["num_new_tokens"] == len(obj["token_ids"]) <= 12


def test_ngram_drafter_streams_identical_text(tiny_llama_dir):
    base = ["generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "24", "--json"]
    plain = json.loads(byblock(*base).stdout)
    spec = json.loads(byblock(*base, "--drafter", "ngram", "--block-size", "4").stdout)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["drafter"] == "ngram" and spec["rounds"] >= 1 and spec["mean_accepted"] >= 1.0


@pytest.mark.parametrize("extra", [(), ("--no-row-invariance",)])
def test_bf16_generate_with_drafter_runs(tiny_llama_dir, extra):
    base = ["generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "24", "--json"]
    base += ["--dtype", "bfloat16", *extra]
    plain = json.loads(byblock(*base).stdout)
    spec = json.loads(byblock(*base, "--drafter", "ngram", "--block-size", "4").stdout)
    if not extra:  # row-invariant (the bf16 default): token-identical by construction (tests/test_invariant.py)
        assert spec["token_ids"] == plain["token_ids"]
    assert spec["num_new_tokens"] == plain["num_new_tokens"] == 24


def test_streaming_output_with_stats_line(tiny_llama_dir):
    r = byblock("generate", "hello", "--model", str(tiny_llama_dir), "--max-new-tokens", "8", "--no-chat")
    assert r.returncode == 0, r.stderr
    assert "new tokens" in r.stderr and "tok/s" in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("generate", "x", "--bogus-flag"),
        ("generate", "x", "--max-new-tokens", "abc"),
        ("generate", "x", "--model", "/no/such/model/dir"),
        ("generate", "x", "--model", "no-such-builtin"),
        ("generate", "x", "--temperature", "-1"),
        ("generate", "x", "--drafter", "magic"),
        ("generate", "x", "--top-p", "2"),
        ("generate", "x", "--drafter", "ngram", "--ngram-min", "4", "--ngram-max", "2"),
        ("generate", "x", "--drafter", "model"),
        ("generate", "x", "--model", "someorg/not-cached-anywhere"),
        ("generate", "x", "--presence-penalty", "5"),
        ("generate", "x", "--min-p", "-1"),
        ("generate", "x", "--logprobs", "99"),
        ("generate", "x", "--json-schema", "{broken"),
        ("generate", "x", "--json-schema", "/no/such/schema.json"),
        ("generate", "x", "--regex", "(a"),
        ("generate", "x", "--regex", "a", "--json-object"),
        ("generate", "x", "--grammar", "/no/such.lark"),
    ],
)
def test_bad_input_one_line_exit_2(args):
    r = byblock(*args)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_prompt_over_context_is_one_line_error(tiny_llama_dir):
    r = byblock("generate", "word " * 2000, "--model", str(tiny_llama_dir), "--no-chat")
    assert r.returncode == 2
    assert "context" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_version_and_models():
    r = byblock("--version")
    assert r.returncode == 0 and r.stdout.startswith("byblock ")
    r = byblock("models", "--json")
    names = {m["name"] for m in json.loads(r.stdout)}
    assert {"smollm2-135m", "gemma3-270m"} <= names


def test_models_prune_cache(tmp_path):
    """`byblock models --prune-cache` deletes a stale conversion and says what it freed."""
    stale = tmp_path / "byblock" / "models" / "old-0123456789abcdef"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 4096)
    r = byblock("models", "--prune-cache", "--json", env_extra={"XDG_CACHE_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"deleted": [str(stale)], "freed_bytes": 4096}
    assert not stale.exists()


def test_linears_flag(tiny_llama_dir):
    """--linears library runs on PyTorch's kernels; a bad choice is an argparse error (exit 2, no traceback)."""
    base = ["generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "8", "--json"]
    r = byblock(*base, "--linears", "library", "--drafter", "ngram")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_new_tokens"] == 8
    bad = byblock(*base, "--linears", "fast")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_draft_model_drafter_from_cli(tiny_llama_dir):
    base = ["generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "16", "--json"]
    plain = json.loads(byblock(*base).stdout)
    r = byblock(*base, "--drafter", f"model:{tiny_llama_dir}", "--block-size", "3")
    spec = json.loads(r.stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["drafter"].startswith("model:") and spec["mean_accepted"] > 1.0  # the target drafting itself


def test_generate_with_a_schema_penalties_and_logprobs(tiny_llama_dir, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            }
        )
    )
    base = ["generate", "def add(a, b):", "--model", str(tiny_llama_dir), "--max-new-tokens", "20", "--json"]
    r = byblock(*base, "--json-schema", str(schema), "--logprobs", "2", "--drafter", "ngram")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert json.loads(obj["text"]) in ({"ok": True}, {"ok": False})
    assert len(obj["logprobs"]) == obj["num_new_tokens"] and len(obj["logprobs"][0]["top"]) == 2
    r = byblock(*base, "--choice", "yes", "--choice", "no", "--repetition-penalty", "1.3", "--presence-penalty", "0.5")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] in ("yes", "no")
