"""`byblock train dllm` and diffusion `byblock generate`: puzzles, resumable training, the CLI on
DiffusionGemma (tiny) and on a trained mask model."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from tiny import make_diffusion_gemma, make_tokenizer

from byblock.dllm import DllmConfig, SamplerKind
from byblock.dllm.denoisers import GemmaDenoiser
from byblock.dllm.generate import diffusion_generate
from byblock.dllm.sudoku import Board, count_solutions, is_solution, make_puzzle
from byblock.training.dllm_train import DllmTrainConfig, DllmTrainer, PuzzleConfig, generate_puzzles

BYBLOCK = [sys.executable, "-m", "byblock.cli.main"]
TINY = DllmTrainConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, steps=6, batch_size=8)


@pytest.mark.parametrize("boxes", [(2, 2), (2, 3), (3, 3)])
def test_generated_puzzles_are_unique_and_valid(boxes):
    board = Board(*boxes)
    rng = random.Random(0)
    for _ in range(3):
        puzzle, solution = make_puzzle(board, rng, min_clues=board.n * 2)
        grid = [int(c) for c in puzzle]
        assert count_solutions(board, grid, limit=2)[0] == 1
        assert is_solution(board, puzzle, solution)
        bad = solution[:-1] + ("1" if solution[-1] != "1" else "2")
        assert not is_solution(board, puzzle, bad)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sudoku")
    generate_puzzles(out, PuzzleConfig(train_puzzles=40, test_puzzles=5), progress=False)
    return out


def test_puzzle_generation_resumes_and_keeps_test_out_of_train(workdir):
    cfg = PuzzleConfig(train_puzzles=40, test_puzzles=5)
    train = (workdir / "data" / "train.jsonl").read_text().splitlines()
    test = {json.loads(ln)["puzzle"] for ln in (workdir / "data" / "test.jsonl").read_text().splitlines()}
    assert len(train) == 40 and not test & {json.loads(ln)["puzzle"] for ln in train}
    (workdir / "data" / "train.jsonl").write_text("\n".join(train[:25]) + '\n{"puzzle": "12')  # a killed run
    generate_puzzles(workdir, cfg, progress=False)
    again = (workdir / "data" / "train.jsonl").read_text().splitlines()
    assert again[:25] == train[:25] and len(again) == 40


@pytest.mark.parametrize("kind", ["mdm", "ar"])
def test_interrupted_training_resumes_bit_exact(workdir, tmp_path, kind):
    import shutil

    runs = {}
    for name in ("straight", "interrupted"):
        out = tmp_path / name
        shutil.copytree(workdir / "data", out / "data")
        cfg = DllmTrainConfig(**{**TINY.__dict__, "kind": kind, "ckpt_every": 1, "eval_every": 100})
        pcfg = PuzzleConfig(train_puzzles=40, test_puzzles=5)
        if name == "interrupted":
            DllmTrainer(out, pcfg, cfg).run(progress=False, until=3)
        trainer = DllmTrainer(out, pcfg, cfg)
        assert trainer.step == (3 if name == "interrupted" else 0)
        trainer.run(progress=False)
        runs[name] = trainer.model.state_dict()
    for k, v in runs["straight"].items():
        assert torch.equal(v, runs["interrupted"][k]), k


def test_train_dllm_cli_and_generate_on_the_mask_model(workdir, tmp_path):
    import shutil

    shutil.copytree(workdir / "data", tmp_path / "data")
    flags = ["--train-puzzles", "40", "--test-puzzles", "5", "--hidden-size", "32", "--num-layers", "1"]
    flags += [
        "--num-heads",
        "2",
        "--intermediate-size",
        "64",
        "--steps",
        "4",
        "--batch-size",
        "8",
        "--eval-puzzles",
        "2",
    ]
    r = subprocess.run(
        [*BYBLOCK, "train", "dllm", "--out", str(tmp_path), "--quiet", *flags], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    export = summary["mdm"]["export"]
    assert (tmp_path / "export-ar" / "config.json").is_file()
    puzzle = json.loads((tmp_path / "data" / "test.jsonl").read_text().splitlines()[0])["puzzle"]
    for sampler in ("threshold", "factor", "entropy", "low-confidence"):
        r = subprocess.run(
            [*BYBLOCK, "generate", puzzle, "--model", export, "--sampler", sampler, "--json"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["num_new_tokens"] == 36 and len(out["text"]) == 36 and out["nfe"] == sum(out["steps_per_block"])
        assert out["tpf"] == pytest.approx(36 / out["nfe"], abs=1e-3)
    r = subprocess.run(
        [*BYBLOCK, "generate", puzzle, "--model", export, "--sampler", "renoise"], capture_output=True, text=True
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_generate_cli_on_diffusion_gemma_matches_library(tmp_path):
    model = make_diffusion_gemma(canvas=8)
    model.save_pretrained(tmp_path)
    tok = make_tokenizer(320)
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    cmd = [*BYBLOCK, "generate", "def add", "--model", str(tmp_path), "--steps", "5", "--max-new-tokens", "16"]
    r = subprocess.run([*cmd, "--seed", "3", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["sampler"] == "renoise" and out["commits"] == 1 and len(out["steps_per_block"]) == 2
    ids = tok("def add", add_special_tokens=False)["input_ids"]
    cfg = DllmConfig(sampler=SamplerKind.RENOISE, steps=5, max_new_tokens=16, seed=3)
    ref = diffusion_generate(GemmaDenoiser(model), ids, cfg, frozenset({1}))
    assert out["token_ids"] == ref.token_ids
    r = subprocess.run([*cmd, "--sampler", "threshold"], capture_output=True, text=True)
    assert r.returncode == 2 and "renoise" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([*cmd, "--threshold", "1.5", "--sampler", "renoise"], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_bench_on_the_shipped_diffusion_models(tmp_path):
    """`byblock bench` on a diffusion checkpoint: frontier rows per sampler setting, the AR twin, the roofline,
    report files and a RESULTS.md section."""
    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, "-m", "byblock.cli.main", "bench", "--model", "sudoku6-mdm", "--ar-model", "sudoku6-ar"]
    cmd += ["--methods", "threshold@0.9,low-confidence@36", "--limit", "4", "--out", str(tmp_path / "out")]
    cmd += ["--quiet", "--update-results", str(results), "--section", "frontier"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["report"].endswith("report.json")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["command"].startswith("byblock bench") and (tmp_path / "out" / "frontier.png").is_file()
    text = results.read_text()
    assert "<!-- bench:frontier -->" in text and "threshold" in text and "low-confidence" in text
