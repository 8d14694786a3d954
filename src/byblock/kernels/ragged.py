"""Attention over a packed batch: several sequences' new tokens in one forward, each against its own KV cache.

The batched engine packs every running request's new rows (a prompt, a plain step, a verify chain or tree)
into one [1, ΣT] forward, so every linear layer streams its weights once for the whole batch. Attention is
the one op that mixes rows, so it is split back per sequence here: each segment appends its K/V to its own
cache and runs the model's attention function on exactly the query, keys, values and mask the same tokens
would have had in a forward of their own. With row-invariant linears (byblock's packed fp32 GEMM, the bf16
row-invariant ones) every token's logits are then bit-identical to what that request computes alone: batch
invariance, tested in tests/test_batch_exact.py.

The plan travels to the attention function as an explicit keyword argument of the model's forward
(transformers passes extra forward kwargs down to its attention functions), never as state on the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the attention kernels import this module: no runtime imports back into them
    from byblock.kernels.invariant import RowInvariance, RowPlan
    from byblock.kv.kv_cache import KVCache

BATCH_KWARG = "byblock_batch"  # the forward kwarg that carries a PackedBatch to the attention functions
# The attention kwarg that marks rows as a prompt's (a prefill or a prefill chunk): they keep the aligned SDPA
# tiles, so a chunked prompt stays bitwise its one-forward prefill (kernels/gqa_sdpa.py).
PROMPT_KWARG = "byblock_prompt"
# The attention kwarg that hands the rows' KVCache to attention functions that keep state beside it (sparse
# decode's block summaries, kv/block_summary.py); passed only to those, so the others never see it.
CACHE_KWARG = "byblock_cache"


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a packed forward.

    masks: the attention mask each layer type gets when these rows run alone ("full_attention",
    "sliding_attention"; None where the lone forward passes none). row_plan: the bf16 row-invariance plan of the
    lone forward (kernels/invariant.py), or None."""

    cache: KVCache
    start: int  # first packed row
    end: int  # one past the last packed row
    masks: dict[str, torch.Tensor | None]
    row_plan: RowPlan | None = None
    prompt: bool = False  # a prompt's rows (see PROMPT_KWARG)


@dataclass(frozen=True)
class PackedBatch:
    """The segments of one packed forward, in row order."""

    segments: tuple[Segment, ...]
    with_cache: bool = False  # pass each segment's cache to `inner` (CACHE_KWARG)

    def attend(
        self,
        inner: Callable[..., tuple[torch.Tensor, None]],
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """query [1, H, ΣT, D], key/value [1, Hkv, ΣT, D] (the new rows only) -> ([1, ΣT, H, D], None).

        Per segment: append its K/V to its cache, then `inner` (the model's attention function) over its query
        rows and its whole cache, with the mask of its own forward."""
        layer = module.layer_idx
        types = getattr(module.config, "layer_types", None)
        kind = types[layer] if types else "full_attention"
        state: RowInvariance | None = getattr(module.config, "byblock_row_invariance", None)
        outs = []
        for seg in self.segments:
            rows = slice(seg.start, seg.end)
            k, v = seg.cache.append(layer, key[:, :, rows], value[:, :, rows])
            if state is not None:
                state.plan = seg.row_plan
            extra = {PROMPT_KWARG: True} if seg.prompt else {}
            if self.with_cache:
                extra[CACHE_KWARG] = seg.cache
            out, _ = inner(module, query[:, :, rows], k, v, seg.masks.get(kind), **kwargs, **extra)
            outs.append(out)
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], None
