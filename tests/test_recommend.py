"""`byblock recommend`: the measured sweep, its ranking and the commands it prints."""

from __future__ import annotations

import json
import shlex

from test_cli import byblock

from byblock.bench.recommend import Ranked, commands, drafter_flags, rank
from byblock.bench.recommend_dllm import dllm_flags, rank_dllm
from byblock.bench.recommend_long import long_flags, rank_long
from byblock.dllm.loading import resolve_dllm


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


def test_rank_dllm_keeps_the_fastest_setting_within_the_quality_budget():
    def row(name, tokens, seconds, solved, agreement=1.0):
        return dict(method=name, tokens=tokens, seconds=seconds, forwards=10, agreement=agreement, solved=solved)

    ranked = rank_dllm(
        [
            row("low-confidence@36", 36, 1.0, 0.8),
            row("threshold@0.5", 36, 0.1, 0.2, 0.7),
            row("threshold@0.99", 36, 0.3, 0.79),
        ],
        max_drop=0.02,
    )
    assert [r.method for r in ranked] == ["threshold@0.99", "low-confidence@36", "threshold@0.5"]
    assert ranked[0].within_budget and not ranked[-1].within_budget and ranked[0].tok_s == 120.0
    assert dllm_flags("threshold@0.99") == ["--sampler", "threshold", "--threshold", "0.99"]
    assert dllm_flags("low-confidence@18") == ["--sampler", "low-confidence", "--steps", "18"]
    assert dllm_flags("renoise@0.1") == ["--sampler", "renoise", "--entropy-bound", "0.1"]


def test_rank_long_prefers_dense_unless_an_option_is_faster_within_budget():
    def row(setting, latency, agreement):
        return dict(setting=setting, ttft_s=0.1, latency_s=latency, decode_tok_s=10.0, kv_mb=1.0, agreement=agreement)

    rows = [row("dense", 1.0, 1.0), row("int4", 0.5, 0.5), row("int8", 0.9, 0.99)]
    assert [r.setting for r in rank_long(rows, 0.02)] == ["int8", "dense", "int4"]
    assert [r.setting for r in rank_long(rows, 0.0)] == ["dense", "int4", "int8"]
    assert long_flags("stem:0.75")[:4] == ["--sparse", "stem", "--sparsity", "0.75"]
    assert long_flags("snapkv:256") == ["--kv-snap", "256"] and long_flags("dense") == []


def test_recommend_sweeps_a_diffusion_checkpoints_samplers_and_its_command_runs():
    r = byblock("recommend", "--model", "sudoku6-mdm", "--limit", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ranked = {row["method"]: row for row in out["ranked"]}
    reference = ranked[out["reference"]]
    assert out["reference"] == "low-confidence@36" and reference["agreement"] == 1.0 and reference["tpf"] == 1.0
    assert reference["within_budget"] and ranked[out["best"]]["within_budget"]
    assert all(row["solved"] is not None for row in out["ranked"])  # a puzzle checkpoint: accuracy measured
    assert any(row["tpf"] > 2 for row in out["ranked"])  # the parallel samplers were measured, not just listed
    puzzle = json.loads((resolve_dllm("sudoku6-mdm") / "test_puzzles.jsonl").read_text().splitlines()[0])["puzzle"]
    cmd = shlex.split(out["commands"]["generate"].replace("PROMPT", shlex.quote(puzzle)))[1:]
    run = byblock(*cmd, "--json")
    assert run.returncode == 0, run.stderr
    bad = byblock("recommend", "--model", "sudoku6-mdm", "--methods", "ar")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1


def test_recommend_long_sweep_measures_each_setting_beside_dense(tiny_llama_dir):
    args = ("--model", str(tiny_llama_dir), "--methods", "ar", "--limit", "1", "--max-new-tokens", "8")
    r = byblock("recommend", *args, "--long", "on", "--json")
    assert r.returncode == 0, r.stderr
    long = json.loads(r.stdout)["long"]
    rows = {row["setting"]: row for row in long["ranked"]}
    assert rows["dense"]["agreement"] == 1.0 and rows["dense"]["within_budget"]
    swept = set(rows) | set(long["skipped"])
    assert len(swept) == 6 and {s.partition(":")[0] for s in swept} == {"dense", "stem", "int8", "int4", "snapkv"}
    assert rows["int4"]["kv_mb"] < rows["dense"]["kv_mb"]  # the quantized cache was really in use
    assert long["best"] in rows and rows[long["best"]]["within_budget"]
    off = byblock("recommend", *args, "--json")  # auto: short prompts skip the long sweep
    assert off.returncode == 0 and json.loads(off.stdout)["long"] is None
    bad = byblock("recommend", *args, "--max-quality-drop", "2")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1
