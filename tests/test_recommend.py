"""`byblock recommend`: the measured sweep, its ranking and the commands it prints."""

from __future__ import annotations

import json
import shlex

from test_cli import byblock

from byblock.bench.recommend import Ranked, commands, drafter_flags, rank


def test_drafter_flags_reproduce_bench_methods():
    assert drafter_flags("ar") == []
    assert drafter_flags("ngram@8") == ["--drafter", "ngram", "--block-size", "8"]
    assert drafter_flags("dflash@16") == ["--drafter", "dflash", "--block-size", "16"]
    assert drafter_flags("ddtree@31") == ["--drafter", "ddtree", "--tree-budget", "31"]
    assert drafter_flags("adaptive-hybrid@31") == ["--drafter", "adaptive-hybrid", "--tree-budget", "31"]
    assert drafter_flags("adaptive@16") == ["--drafter", "adaptive-dflash", "--tree-budget", "16"]
    assert "launch" in commands("dflash@16", "smollm2-135m", 1) and "launch" not in commands("ngram@4", "m", 1)
    assert commands("ngram@4", "m", 8)["serve"].endswith("--max-num-seqs 8")


def test_rank_puts_lossy_rows_last_whatever_their_speed():
    row = dict(tok_s=10.0, speedup=1.0, tau=None, mismatched_turns=0)
    ranked = rank(
        {
            "ar": row,
            "fast-but-wrong": {**row, "tok_s": 99.0, "mismatched_turns": 2},
            "ngram@4": {**row, "tok_s": 20.0, "tau": 1.5},
        }
    )
    assert [r.method for r in ranked] == ["ngram@4", "ar", "fast-but-wrong"]
    assert isinstance(ranked[0], Ranked) and not ranked[-1].lossless


def test_recommend_cli_ranks_and_its_command_runs(tiny_llama_dir):
    r = byblock(
        "recommend",
        "--model",
        str(tiny_llama_dir),
        "--methods",
        "ar,ngram@4,ngram@8,dflash@8",
        "--limit",
        "2",
        "--max-new-tokens",
        "16",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    methods = [row["method"] for row in out["ranked"]]
    assert set(methods) == {"ar", "ngram@4", "ngram@8"}  # dflash: no drafter ships for this model, skipped
    assert any("skipped dflash@8" in n for n in out["notes"])
    assert all(row["lossless"] for row in out["ranked"])
    speeds = [row["tok_s"] for row in out["ranked"]]
    assert speeds == sorted(speeds, reverse=True) and out["best"] == methods[0]
    cmd = shlex.split(out["commands"]["generate"].replace("PROMPT", "hi"))[1:]
    run = byblock(*cmd, "--max-new-tokens", "4", "--json")
    assert run.returncode == 0, run.stderr
    table = byblock(
        "recommend",
        "--model",
        str(tiny_llama_dir),
        "--methods",
        "ar,ngram@4",
        "--limit",
        "1",
        "--max-new-tokens",
        "8",
        "--target",
        "throughput",
        "--batch",
        "2",
    )
    assert table.returncode == 0, table.stderr
    assert (
        "| rank | method |" in table.stdout and "byblock serve" in table.stdout and "--max-num-seqs 2" in table.stdout
    )
    bad = byblock("recommend", "--model", str(tiny_llama_dir), "--methods", "ar,warp9")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
