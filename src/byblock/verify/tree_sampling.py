"""Sampled verification of deterministic candidates (trees, lookup chains): sample, then follow the match.

At the current node (the root first) draw y ~ p from the target's row for that node; if a child carries y, move
to it and repeat, else emit y and stop. Every emitted token is a fresh sample from p given the emitted prefix,
whatever the candidates were, so the output is distributed exactly as plain sampling (SpecInfer's
deterministic-candidate case). Only the rows on the path are processed and sampled — τ rows per round, not
N+1: with top-p each processed row is a sort of the whole vocabulary.
"""

from __future__ import annotations

from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits
from byblock.verify.greedy import follow
from byblock.verify.types import Draft, Noise, Rows, Verdict


def walk_sampled(draft: Draft, target_logits: Rows, params: SamplingParams, noise: Noise) -> Verdict:
    """target_logits: [N+1, V] (row 0 = root, row i+1 = node i), read and processed row by row as the walk
    reaches them. Equals reference_tree_sampling on process_logits(target_logits, params)."""

    def sample_row(row: int) -> int:
        p = process_logits(target_logits[row], params)  # [V]
        return int((p / noise.exp_row(row)).argmax())

    return follow(draft, sample_row)
