"""`byblock loadgen` against the in-process tiny server: bounded, counted, recorded."""

from __future__ import annotations

import json

from serving import running
from test_server import build_app

from byblock.cli.main import main


def test_loadgen_levels_and_results_section(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"The quick brown fox {i}"}) + "\n" for i in range(5)))
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\n<!-- bench:load -->\nold\n<!-- /bench:load -->\n")
    _, app = build_app()
    with running(app) as url:
        args = ["loadgen", "--url", url, "--drafters", "none,ngram", "--concurrency", "1,3", "--requests", "6"]
        args += ["--max-tokens", "8", "--dataset-path", str(prompts), "--out", str(tmp_path)]
        args += ["--update-results", str(results), "--section", "load"]
        assert main(args) == 0
        metrics = app.state.metrics.render().decode()
    levels = json.loads((tmp_path / "load.json").read_text())["levels"]
    assert [(lv["drafter"], lv["concurrency"]) for lv in levels] == [
        ("none", 1),
        ("ngram", 1),
        ("none", 3),
        ("ngram", 3),
    ]
    for lv in levels:
        assert lv["requests"] == 6 and lv["errors"] == 0 and lv["completion_tokens"] == 48
        # each request's first token comes no later than its last, so the order holds for every quantile;
        # no wall-clock bound: a first request that pays a one-time warm-up must not fail the test
        assert 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"] and lv["ttft_p50_s"] <= lv["e2e_p50_s"]
    # 4 levels x (6 + 1 warm-up) requests reached the server
    assert 'byblock_requests_total{endpoint="chat",status="ok"} 28.0' in metrics
    text = results.read_text()
    assert "old" not in text and "| ngram | 3 | 6 (0) |" in text
    assert "| drafter | clients |" in capsys.readouterr().out


def test_loadgen_without_server_is_one_line(capsys):
    assert main(["loadgen", "--url", "http://127.0.0.1:9", "--requests", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no OpenAI-compatible server" in err


def test_loadgen_sends_raw_prompts_to_completions(tmp_path):
    """Rows marked "chat": false (HumanEval's shape) go to /v1/completions, and their streamed text is timed."""
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n", "chat": False}) + "\n" for i in range(3)))
    _, app = build_app()
    with running(app) as url:
        args = ["loadgen", "--url", url, "--concurrency", "2", "--requests", "4", "--max-tokens", "6"]
        args += ["--dataset-path", str(prompts), "--out", str(tmp_path)]
        assert main(args) == 0
        metrics = app.state.metrics.render().decode()
    (level,) = json.loads((tmp_path / "load.json").read_text())["levels"]
    assert level["errors"] == 0 and level["completion_tokens"] == 24
    assert 0 < level["ttft_p50_s"] <= level["e2e_p50_s"]
    assert 'byblock_requests_total{endpoint="completions",status="ok"} 5.0' in metrics  # 4 + the warm-up


def test_loadgen_refuses_mixed_prompt_kinds(tmp_path, capsys):
    prompts = tmp_path / "mixed.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "def f():", "chat": False}) + "\n")
    assert main(["loadgen", "--url", "http://127.0.0.1:9", "--dataset-path", str(prompts)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mix chat and raw" in err  # refused before any request is sent
