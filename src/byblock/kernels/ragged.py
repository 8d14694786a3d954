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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the attention kernels import this module: no runtime imports back into them
    from byblock.kernels.invariant import RowInvariance, RowPlan
    from byblock.kernels.row_attention import RowAttention
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
    # The row-local kernel, to run every decode / verify segment of a layer in one call (`attend`); None: each
    # segment through `inner`. Only where `inner` would pick that kernel for them: byblock's dense attention in
    # fp32 on the CPU, without the bf16 row-invariance plans.
    rows: RowAttention | None = None
    # Per layer type, the plan `_attend_rows` builds at the forward's first layer (scratch, never compared).
    _direct: dict = field(default_factory=dict, compare=False, repr=False)

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
        if self.rows is not None:
            return self._attend_rows(self.rows, inner, module, query, key, value, layer, kind, **kwargs), None
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

    def _attend_rows(
        self,
        kernel: RowAttention,
        inner: Callable[..., tuple[torch.Tensor, None]],
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer: int,
        kind: str,
        **kwargs,
    ) -> torch.Tensor:
        """`attend` with every segment the row-local kernel serves (a cached past, a plain key-set mask,
        appending buffers) in one kernel call; the rest (prompts, first forwards, other caches) through `inner`.

        Why: per segment, the append and the kernel call cost ~70 µs of Python and dispatch; a 16-request step
        made 480 of them, most of its time (dev/LOG.md, session 33). The kernel computes each row as the
        segment's own call would, so the output is bitwise the per-segment path's (tests/test_row_attention.py)."""
        plan = self._direct.get(kind)
        if plan is None:
            plan = self._direct[kind] = self._plan_rows(module.config.num_hidden_layers, kind, query.device)
        table, slow = plan
        h, d = query.shape[1], query.shape[3]
        scale = kwargs.get("scaling")
        out = torch.empty(query.shape[2], h, d, dtype=query.dtype, device=query.device)
        if table is not None:
            kernel.packed(query, key, value, table[layer], d**-0.5 if scale is None else scale, out)
        for seg in slow:
            rows = slice(seg.start, seg.end)
            k, v = seg.cache.append(layer, key[:, :, rows], value[:, :, rows])
            extra = {PROMPT_KWARG: True} if seg.prompt else {}
            out[rows] = inner(module, query[:, :, rows], k, v, seg.masks.get(kind), **kwargs, **extra)[0][0]
        return out[None]

    def _plan_rows(self, n_layers: int, kind: str, device: torch.device) -> tuple[torch.Tensor | None, list[Segment]]:
        """Once per forward: the kernel's segment table for every layer [L, n, SEGMENT_FIELDS] and the segments
        left to `inner`. Every layer's buffers are grown and their slot counts advanced here, so a layer's call
        is one kernel call (the kernel writes the new slots; nothing reads these caches' lengths meanwhile)."""
        from byblock.kernels.row_attention import key_sets  # runtime import: row_attention imports nothing here
        from byblock.kv.kv_buffer import BufferedLayer

        per_layer: list[list[tuple[int, ...]]] = [[] for _ in range(n_layers)]
        slow, grown = [], []
        for seg in self.segments:
            t = seg.end - seg.start
            layers = seg.cache.hf.layers
            direct = not seg.prompt and len(layers) == n_layers
            direct = direct and all(isinstance(c, BufferedLayer) and c.is_initialized for c in layers)
            past = layers[0].get_seq_length() if direct else 0
            direct = direct and past > 0 and all(c.get_seq_length() == past for c in layers)
            rows = key_sets(seg.masks.get(kind), t, past + t) if direct else False
            if rows is False:
                slow.append(seg)
                continue
            mask = 0 if rows is None else rows.data_ptr()  # the memo keeps it alive as long as the segment's mask
            heads = 1 if rows is None or rows.dim() == 3 else rows.shape[1]
            for i, cached in enumerate(layers):
                kbuf, vbuf = cached.room(t)
                per_layer[i].append(
                    (seg.start, seg.end, past, kbuf.data_ptr(), vbuf.data_ptr(), *kbuf.stride()[1:3],
                     *vbuf.stride()[1:3], mask, heads)
                )  # fmt: skip
                grown.append((cached, t))
        for cached, t in grown:
            cached.advance(t)
        if not per_layer[0]:
            return None, slow
        return torch.tensor(per_layer, dtype=torch.int64, device=device), slow
