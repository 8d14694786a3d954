"""Diffusion-LM benchmark on the puzzle task: accuracy vs tokens-per-forward for every sampler setting,
wall-clock against the same-size AR model, and the CPU roofline that decides who wins.

Methods are `SAMPLER[@VALUE]`: threshold@τ, factor@f, entropy@γ, low-confidence@steps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from byblock.dllm.config import DllmConfig, SamplerKind
from byblock.dllm.denoisers import MaskDenoiser
from byblock.dllm.sudoku import Board, is_solution, solve_ar, solve_mdm
from byblock.errors import ByblockError

KNOB = {
    SamplerKind.THRESHOLD: "threshold",
    SamplerKind.FACTOR: "factor",
    SamplerKind.ENTROPY: "entropy_bound",
    SamplerKind.LOW_CONFIDENCE: "steps",
}


@dataclass(frozen=True)
class DllmMethod:
    """One sampler setting."""

    name: str
    cfg: DllmConfig

    @staticmethod
    def parse(text: str, base: DllmConfig) -> DllmMethod:
        """'threshold@0.9' -> DllmMethod (one-line errors for anything else)."""
        name, _, value = text.partition("@")
        try:
            kind = SamplerKind(name)
        except ValueError:
            raise ByblockError(
                f"unknown sampler '{name}' in --methods (choose from {', '.join(k.value for k in KNOB)})"
            ) from None
        if kind not in KNOB:
            raise ByblockError(f"sampler '{name}' needs a uniform-state model; the puzzle models use mask samplers")
        cfg = replace(base, sampler=kind)
        if value:
            field = KNOB[kind]
            try:
                cfg = replace(cfg, **{field: int(value) if field == "steps" else float(value)})
            except ValueError:
                raise ByblockError(f"bad value '{value}' for {name}") from None
        return DllmMethod(text, cfg)


def load_puzzles(path: Path, limit: int) -> list[tuple[str, str]]:
    """(puzzle, solution) pairs."""
    if not path.is_file():
        raise ByblockError(f"no puzzle file at {path}")
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()][:limit]
    return [(r["puzzle"], r["solution"]) for r in rows]


@torch.inference_mode()
def roofline(hf_model, prompt_len: int, sizes: tuple[int, ...] = (1, 8, 16, 32, 64), repeats: int = 20) -> dict:
    """Seconds of one forward of k new tokens over a cached prompt, and its ratio to k = 1 (one AR step)."""
    from byblock.kv.kv_cache import KVCache

    vocab = hf_model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, prompt_len))
    out = {}
    for k in sizes:
        kv = KVCache()
        cache = kv.hf
        hf_model(input_ids=prompt, cache=cache, use_cache=True)
        new = torch.randint(0, vocab, (1, k))
        pos = torch.arange(prompt_len, prompt_len + k)[None]
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            hf_model(input_ids=new, cache=cache, position_ids=pos, use_cache=True)
            times.append(time.perf_counter() - t)
            kv.crop(prompt_len)
        out[k] = sorted(times)[len(times) // 2]
    base = out[sizes[0]]
    return {str(k): {"seconds": round(v, 6), "vs_ar_step": round(v / base, 3)} for k, v in out.items()}


def run_frontier(
    mdm_dir: Path, ar_dir: Path | None, puzzles: list[tuple[str, str]], methods: list[DllmMethod], progress=None
) -> dict:
    """Accuracy, TPF and time per puzzle for every method (and the AR twin), plus the roofline."""
    from byblock.dllm.loading import load_dllm

    loaded = load_dllm(str(mdm_dir))
    model, tok = loaded.denoiser, loaded.tokenizer
    assert isinstance(model, MaskDenoiser)
    board = Board(*loaded.meta.get("board", (2, 3)))
    rows = {}
    for m in methods:
        solved = nfe = 0
        t = time.perf_counter()
        for p, _ in puzzles:
            answer, n = solve_mdm(model, tok, p, m.cfg)
            solved += is_solution(board, p, answer)
            nfe += n
        dt = time.perf_counter() - t
        rows[m.name] = {
            "sampler": m.cfg.sampler.value,
            "accuracy": solved / len(puzzles),
            "tpf": len(puzzles) * len(puzzles[0][0]) / nfe,
            "nfe_per_puzzle": nfe / len(puzzles),
            "s_per_puzzle": dt / len(puzzles),
        }
        if progress:
            progress(m.name, rows[m.name])
    report: dict = {"puzzles": len(puzzles), "cells": len(puzzles[0][0]), "methods": rows}
    if ar_dir is not None:
        from transformers import AutoModelForCausalLM

        ar = AutoModelForCausalLM.from_pretrained(ar_dir).eval()
        t = time.perf_counter()
        solved = sum(is_solution(board, p, solve_ar(ar, tok, p)) for p, _ in puzzles)
        dt = time.perf_counter() - t
        report["ar"] = {"accuracy": solved / len(puzzles), "tpf": 1.0, "s_per_puzzle": dt / len(puzzles)}
        if progress:
            progress("ar", report["ar"])
    report["roofline"] = roofline(model.hf, prompt_len=len(puzzles[0][0]) + 1)
    return report


def markdown(report: dict) -> str:
    """RESULTS.md tables: the frontier and the roofline."""
    ar = report.get("ar")
    lines = [
        "| method | accuracy | TPF | forwards / puzzle | ms / puzzle | vs AR wall-clock |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    if ar:
        ms = ar["s_per_puzzle"] * 1e3
        lines.append(f"| AR (greedy) | {ar['accuracy']:.1%} | 1.00 | {report['cells']} | {ms:.1f} | 1.00× |")
    for name, r in report["methods"].items():
        speed = f"{ar['s_per_puzzle'] / r['s_per_puzzle']:.2f}×" if ar else "—"
        lines.append(
            f"| {name} | {r['accuracy']:.1%} | {r['tpf']:.2f} | {r['nfe_per_puzzle']:.1f} | "
            f"{r['s_per_puzzle'] * 1e3:.1f} | {speed} |"
        )
    lines += ["", "| canvas tokens k | forward ms | cost / AR step |", "|---:|---:|---:|"]
    for k, v in report["roofline"].items():
        lines.append(f"| {k} | {v['seconds'] * 1e3:.2f} | {v['vs_ar_step']:.2f} |")
    return "\n".join(lines) + "\n"


def plot_frontier(report: dict, path: Path) -> None:
    """Accuracy vs TPF, one line per sampler family, the AR model as a point at TPF 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    families: dict[str, list[tuple[float, float, str]]] = {}
    for name, r in report["methods"].items():
        families.setdefault(r["sampler"], []).append((r["tpf"], r["accuracy"], name.partition("@")[2]))
    for fam, pts in families.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        for x, y, lab in pts:
            ax.annotate(lab, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    if "ar" in report:
        ax.scatter(
            [1.0], [report["ar"]["accuracy"]], marker="*", s=150, color="black", label="AR (same size)", zorder=5
        )
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("puzzles solved")
    ax.set_title(f"6x6 Sudoku, {report['puzzles']} held-out puzzles")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
