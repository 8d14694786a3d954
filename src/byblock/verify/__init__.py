"""Verification: decide which drafted tokens the target accepts. Pure tensor functions, no model calls."""

from __future__ import annotations

import torch

from byblock.sampling.params import SamplingParams
from byblock.verify.greedy import verify_greedy
from byblock.verify.rejection import rejection_chain
from byblock.verify.rows import ProcessedRows, TargetRows
from byblock.verify.tree_sampling import walk_sampled
from byblock.verify.types import Draft, Noise, Verdict

__all__ = ["Draft", "Noise", "TargetRows", "Verdict", "verify"]


def verify(
    draft: Draft,
    target_logits: torch.Tensor | TargetRows,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Accept a path of `draft` against target_logits [N+1, V] (row 0 = root). Lossless in every mode.

    Every rule reads the rows on its path only, so `TargetRows` (logits computed on first read) spend the
    target's LM head on those rows alone.
    greedy                      -> follow the target's argmax (chains and trees)
    sampling, chain with q      -> speculative sampling with the residual (rejection.py)
    sampling, deterministic/tree-> sample y ~ p at each node, follow the matching child (tree_sampling.py)
    """
    if params.greedy:
        return verify_greedy(draft, target_logits)
    noise = Noise.draw(draft.num_nodes, target_logits.shape[-1], generator, target_logits.device)
    if draft.q is not None and draft.is_chain and draft.num_nodes:
        return rejection_chain(draft, ProcessedRows(target_logits, params), noise)
    return walk_sampled(draft, target_logits, params, noise)
