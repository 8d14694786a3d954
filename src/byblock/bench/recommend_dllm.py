"""`byblock recommend` for diffusion checkpoints: the sampler sweep, ranked by speed within a quality budget.

A diffusion model has no lossless fast path: every parallel sampler trades quality for tokens per forward. So
the sweep measures each sampler setting against the most careful one — the reference: one token committed per
forward for mask models (LLaDA low-confidence with steps = block size), the tightest entropy bound for
DiffusionGemma-style renoising — on the user's prompts, and reports the quality delta beside the speed:
    agreement  the fraction of the reference's tokens the setting reproduces at the same positions
    solved     for puzzle checkpoints (byblock_dllm.json "task": "sudoku"), the fraction of puzzles solved
The recommendation is the fastest setting whose quality stays within `max_drop` of the reference's (solved
where it is measured, else agreement); the rest are ranked after it, slowest-but-closest never hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from byblock.bench.dllm import DllmMethod
from byblock.dllm.config import DllmConfig, SamplerKind

MASK_SWEEP = (
    "threshold@0.99",
    "threshold@0.95",
    "threshold@0.9",
    "threshold@0.7",
    "threshold@0.5",
    "factor@1",
    "factor@2",
    "entropy@0.1",
    "entropy@1",
)
RENOISE_SWEEP = (0.01, 0.1, 0.3, 1.0)  # entropy bounds γ; the first is the reference


def dllm_candidates(mask_model: bool, block: int, base: DllmConfig) -> list[DllmMethod]:
    """The settings swept, reference first: mask samplers for mask models, entropy bounds for renoising ones."""
    if mask_model:
        fixed = dict.fromkeys(max(1, block // d) for d in (1, 2, 4))  # 1, 2 and 4 tokens per forward
        names = [f"low-confidence@{steps}" for steps in fixed] + list(MASK_SWEEP)
        return [DllmMethod.parse(n, base) for n in names]
    renoise = replace(base, sampler=SamplerKind.RENOISE)
    return [DllmMethod(f"renoise@{g}", replace(renoise, entropy_bound=g)) for g in RENOISE_SWEEP]


@dataclass(frozen=True)
class DllmRow:
    """One measured sampler setting."""

    method: str
    tok_s: float
    tpf: float  # tokens per denoising forward
    agreement: float  # of the reference's tokens, at the same positions
    solved: float | None  # puzzles solved (puzzle checkpoints only)
    within_budget: bool  # quality within max_drop of the reference


def sweep_dllm(
    loaded, prompts: list[list[int]], methods: list[DllmMethod], check=None, progress=lambda name, row: None
) -> list[dict]:
    """Run every method on every prompt (first method = the reference) -> one raw row per method: tokens,
    seconds, forwards, agreement with the reference, solved (when `check(i, token_ids)` says so per prompt)."""
    from byblock.dllm.generate import diffusion_generate

    reference: list[list[int]] = []
    rows = []
    for m in methods:
        tokens = forwards = matched = solved = 0
        seconds = 0.0
        for i, ids in enumerate(prompts):
            with torch.inference_mode():
                t = time.perf_counter()
                res = diffusion_generate(loaded.denoiser, ids, m.cfg, loaded.eos_token_ids)
                seconds += time.perf_counter() - t
            out = res.token_ids
            if len(reference) < len(prompts):
                reference.append(out)
            ref = reference[i]
            matched += sum(a == b for a, b in zip(out, ref, strict=False))
            tokens += len(out)
            forwards += res.nfe
            solved += bool(check(i, out)) if check else 0
        row = {
            "method": m.name,
            "tokens": tokens,
            "seconds": seconds,
            "forwards": forwards,
            "agreement": matched / max(1, sum(len(r) for r in reference)),
            "solved": solved / len(prompts) if check else None,
        }
        rows.append(row)
        progress(m.name, row)
    return rows


def rank_dllm(rows: list[dict], max_drop: float) -> list[DllmRow]:
    """Raw rows (reference first) -> fastest first among those within `max_drop` of the reference's quality
    (solved where measured, else agreement), then the others, fastest first."""
    ref = rows[0]
    quality = "solved" if ref["solved"] is not None else "agreement"
    out = [
        DllmRow(
            method=r["method"],
            tok_s=r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
            tpf=r["tokens"] / r["forwards"] if r["forwards"] else 0.0,
            agreement=r["agreement"],
            solved=r["solved"],
            within_budget=r[quality] >= ref[quality] - max_drop - 1e-12,
        )
        for r in rows
    ]
    return sorted(out, key=lambda r: (not r.within_budget, -r.tok_s))


def dllm_flags(method: str) -> list[str]:
    """The generate / serve flags that reproduce a swept setting ('threshold@0.7' -> --sampler threshold ...)."""
    name, _, value = method.partition("@")
    knob = {"low-confidence": "--steps", "threshold": "--threshold", "factor": "--factor"}.get(name, "--entropy-bound")
    return ["--sampler", name, knob, value]


def dllm_commands(method: str, model: str) -> dict[str, str]:
    """The commands that run the winning sampler setting."""
    flags = " ".join(dllm_flags(method))
    return {
        "generate": f"byblock generate PROMPT --model {model} {flags}",
        "serve": f"byblock serve --model {model} {flags}",
    }


def dllm_table(ranked: list[DllmRow], reference: str) -> str:
    """The ranked table as Markdown."""
    solved = ranked[0].solved is not None
    head = "| rank | sampler | tok/s | TPF | agreement with " + reference + (" | solved" if solved else "")
    lines = [head + " | within budget |", "|---:|---|---:|---:|---:|" + ("---:|" if solved else "") + "---|"]
    for i, r in enumerate(ranked, 1):
        cells = [str(i), r.method, f"{r.tok_s:.1f}", f"{r.tpf:.2f}", f"{r.agreement:.1%}"]
        if solved:
            cells.append(f"{r.solved:.1%}")
        cells.append("yes" if r.within_budget else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
