"""`byblock recommend`: seed 000 §3's selection tree made empirical — measure the candidates on the user's own
prompts and rank them, instead of guessing from the tree.

The tree, as the seed states it:              what the sweep measures instead
    repetitive / long-context input -> lookup        ngram (chain, trie)
    a trained block drafter exists  -> DFlash/DDTree  dflash@8/16, ddtree@31, hybrid@31 (lookup + DDTree)
    latency-bound, batch 1          -> deep drafts    the adaptive drafters, sized per round from measured costs
    throughput-bound, many requests -> shallow/none   the same set at --batch N on the batched engine
A candidate that cannot be built for the model (no shipped drafter) is skipped and said so. Every candidate
is greedy-checked against plain decoding on every prompt: a lossy row would be reported, never recommended.
"""

from __future__ import annotations

from dataclasses import dataclass

from byblock.bench.methods import MethodSpec
from byblock.drafters import DrafterKind

LOOKUP = ("ngram@4", "ngram@8")
BLOCK = ("dflash@8", "dflash@16", "ddtree@31", "hybrid@31", "adaptive@16", "adaptive-hybrid@31")
TREES = (DrafterKind.DDTREE, DrafterKind.HYBRID, DrafterKind.DOMINO_TREE, DrafterKind.EAGLE3_TREE)


def candidates(target: str) -> list[str]:
    """The methods swept for a latency or throughput target (plain decoding `ar` first)."""
    if target == "throughput":  # wide batches leave little idle compute for drafts: fewer, cheaper rows
        return ["ar", "ngram@4", "dflash@8", "adaptive-hybrid@31"]
    return ["ar", *LOOKUP, *BLOCK]


@dataclass(frozen=True)
class Ranked:
    """One measured candidate."""

    method: str
    tok_s: float
    speedup: float
    tau: float | None
    lossless: bool
    mismatched_turns: int


def rank(rows: dict[str, dict]) -> list[Ranked]:
    """Summary rows of one dataset (bench/runner.py MethodTotals.summary) -> best first; lossy ones last."""
    out = [
        Ranked(
            method=name,
            tok_s=row["tok_s"],
            speedup=row["speedup"] or 0.0,
            tau=row["tau"],
            lossless=row["mismatched_turns"] == 0,
            mismatched_turns=row["mismatched_turns"],
        )
        for name, row in rows.items()
    ]
    return sorted(out, key=lambda r: (not r.lossless, -r.tok_s))


def drafter_flags(method: str) -> list[str]:
    """The generate / serve flags that reproduce a bench method (bench's @K is the block size for chains and
    the node budget for trees and adaptive drafters)."""
    spec = MethodSpec.parse(method)
    if spec.drafter is None:
        return []
    d = spec.drafter
    name = d.kind.value
    if d.adaptive:
        name = "adaptive-" + name
    flags = ["--drafter", name + (f":{d.model}" if d.model else "")]
    if spec.size is not None:
        tree = d.kind in TREES or d.adaptive
        flags += ["--tree-budget" if tree else "--block-size", str(spec.size)]
    return flags


def commands(method: str, model: str, batch: int) -> dict[str, str]:
    """The commands that run the winner: generate, serve, and the vLLM handoff where the drafter exports."""
    flags = " ".join(drafter_flags(method))
    out = {
        "generate": f"byblock generate PROMPT --model {model} {flags}".rstrip(),
        "serve": f"byblock serve --model {model} {flags}".rstrip() + (f" --max-num-seqs {batch}" if batch > 1 else ""),
    }
    spec = MethodSpec.parse(method)
    if spec.drafter is not None and spec.drafter.kind is DrafterKind.DFLASH and not spec.drafter.adaptive:
        out["launch"] = f"byblock launch vllm --model {model}  (vLLM serves the exported DFlash drafter)"
    return out


def table(ranked: list[Ranked]) -> str:
    """The ranked table as Markdown."""
    lines = ["| rank | method | tok/s | speedup | τ | lossless |", "|---:|---|---:|---:|---:|---|"]
    for i, r in enumerate(ranked, 1):
        tau = f"{r.tau:.2f}" if r.tau is not None else "—"
        ok = "yes" if r.lossless else f"NO ({r.mismatched_turns} turns differ)"
        lines.append(f"| {i} | {r.method} | {r.tok_s:.1f} | {r.speedup:.2f}× | {tau} | {ok} |")
    return "\n".join(lines)
