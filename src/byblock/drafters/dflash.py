"""DFlash drafter: one forward of a small block-diffusion network drafts a whole chain (seed 002).

Per round (reference `dflash_generate`, byblock's engine contract):
    context   target features of every committed token before the anchor; new ones are projected once and
              appended to the drafter's own context K/V cache (so a round costs O(B), not O(context))
    block     [x_a, MASK × (B−1)] at positions a .. a+B−1, embedded with the target's frozen embedding
    draft     rows 1..B−1 of target_lm_head(drafter(block, context))  (greedy: argmax; sampling: a draw from
              the processed distribution q, which verification then corrects for — lossless either way)
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from byblock.drafters.dflash_model import DFlashDraftModel
from byblock.drafters.dflash_packed import DraftCache, DraftRunner, PackedBlock
from byblock.drafters.features import PendingFeatures
from byblock.errors import ByblockError
from byblock.kernels import invariant_head
from byblock.kernels.quant_embedding import embed_rows
from byblock.models.adapter import TargetModel
from byblock.models.devices import device_clock
from byblock.sampling.draft_adjust import DraftAdjust
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits, sample
from byblock.verify.types import Draft, Verdict


def check_compatible(model: DFlashDraftModel, target: TargetModel) -> None:
    """Refuse a drafter trained for another target shape (a one-line error, not a shape crash later)."""
    cfg = model.config
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} vs target {target.hidden_size}")
    if max(cfg.target_layer_ids) >= target.num_layers:
        problems.append(f"feature layers {list(cfg.target_layer_ids)} but the target has {target.num_layers}")
    if cfg.vocab_size and cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs target {target.vocab_size}")
    if problems:
        raise ByblockError(f"DFlash drafter does not fit target '{target.name}': {'; '.join(problems)}")


class DFlashDrafter:
    """Drafter protocol over a DFlashDraftModel and its target's embedding and LM head."""

    name = "dflash"

    def __init__(
        self,
        model: DFlashDraftModel,
        target: TargetModel,
        block: int | None = None,
        draft_vocab: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: run the drafter in this dtype (bf16: both weight layouts, bf16 GEMMs for the block rows)."""
        check_compatible(model, target)
        if dtype is not None and dtype != next(model.parameters()).dtype:
            from byblock.kernels.fast_linear import dual_layout_linears

            model = model.to(dtype)
            dual_layout_linears(model)
        self.model = model.eval()
        self.runner = DraftRunner(self.model)  # the inference forward, shared by forks (dflash_packed.py)
        self.block = block or model.config.block_size  # B: tokens per drafter forward, anchor included
        if self.block < 2:
            raise ByblockError("a DFlash block needs at least 2 tokens (anchor + one draft)")
        self.block_size = self.block - 1  # the deepest draft (Drafter protocol)
        self.hidden_layers = tuple(model.config.target_layer_ids)
        self.mask_token_id = model.config.mask_token_id
        self.vocab_size = target.vocab_size
        # The reference embeds with the raw table (any in-model embedding scale is bypassed).
        self.embedding = target.hf.get_input_embeddings()  # read through embed_rows (raw rows, any kind)
        self.device = target.device  # the target's: the drafter runs beside it
        head = target.hf.get_output_embeddings()
        self.draft_vocab = draft_vocab
        # The target's head on its row-invariant kernel (packed fp32 or quantized), if it has one.
        self.packed_head: nn.Module | None = None
        self.head_t: torch.Tensor | None = None  # else [H, Vd] for a library matmul
        if dtype in (None, torch.float32):
            self.packed_head = invariant_head(head, draft_vocab)
        if self.packed_head is None:
            head_t = head.weight_t if hasattr(head, "weight_t") else head.weight.t()  # [H, V]
            if draft_vocab is not None:
                head_t = head_t[:, draft_vocab]  # [H, Vd]: a restricted head is a cheaper drafter forward
            head_dtype = dtype or head_t.dtype
            self.head_t = head_t.to(head_dtype).contiguous() if draft_vocab is not None or dtype else head_t
        self.softcap = getattr(target.text_config, "final_logit_softcapping", None)
        self.dtype = next(model.parameters()).dtype
        self._cache: DraftCache | None = None  # the request's context K/V (set by start)
        self._pending: PendingFeatures | None = None  # target features not yet in the drafter cache
        self._params = SamplingParams()
        self._generator: torch.Generator | None = None
        self.adjust: DraftAdjust | None = None  # the request's penalties / grammar, applied to the draft rows
        self._vocab_host: list[int] | None = None  # draft_vocab as a list, made on first host-side use
        # (anchor position, logits [D, Vd], states [D, H], its share of the batched forward's seconds)
        self._prefetched: tuple[int, torch.Tensor, torch.Tensor, float] | None = None
        self._borrowed_s = 0.0  # the share of the last prefetched block, not yet counted by a caller

    def start(
        self,
        prompt_ids: list[int],
        target_hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        adjust: DraftAdjust | None = None,
    ) -> None:
        """Reset; the prompt's features become the first context."""
        if target_hidden is None:
            raise ByblockError("the DFlash drafter needs the target's hidden states")
        self.adjust = adjust
        self._cache = self.runner.new_cache()
        self._pending = PendingFeatures(target_hidden[0])
        self._prefetched = None
        self._params, self._generator = params, generator

    def fork(self) -> DFlashDrafter:
        """Shares the network, embedding and head; fresh context cache (set by start)."""
        clone = copy.copy(self)
        clone._cache, clone._pending = None, None
        clone._params, clone._generator, clone._prefetched, clone._borrowed_s = SamplingParams(), None, None, 0.0
        clone.adjust = None
        return clone

    def block_request(self, tokens: list[int], max_depth: int) -> tuple[DFlashDrafter, int, int | None] | None:
        """The backbone forward the next propose() runs: (drafter, depth, block rows or None for its own block),
        for the batched engine's draft_blocks, which runs many requests' blocks in one forward."""
        return self, min(self.block_size, max_depth), None

    def draft_logits(
        self, anchor: int, anchor_pos: int, depth: int, return_hidden: bool = False, rows: int | None = None
    ):
        """Run the drafter once over a block of `rows` positions (None: the drafter's block); logits [depth,
        V_draft] for positions anchor_pos+1 .. anchor_pos+depth (and the draft states [depth, H] they came from,
        with return_hidden). A block the batched engine already drafted for this anchor (draft_blocks) is
        returned instead of running again."""
        pre = self._prefetched
        if pre is not None and pre[0] == anchor_pos and depth <= pre[1].shape[0]:
            self._prefetched = None
            self._borrowed_s = pre[3]
            logits, states = pre[1][:depth], pre[2][:depth]
            return (logits, states) if return_hidden else logits
        self._prefetched = None
        block = self.block_input(anchor, anchor_pos, rows)
        with torch.inference_mode():
            h = self.runner([block])  # [B, H]: the same forward as a batched block's
            states = h[1 : 1 + depth]  # [depth, H]
            logits = self.head_logits(states)
        self._consumed(anchor_pos)
        return (logits, states) if return_hidden else logits

    def take_borrowed_s(self) -> float:
        """Seconds of a batched forward the last draft_logits call used without timing them (then zero)."""
        borrowed, self._borrowed_s = self._borrowed_s, 0.0
        return borrowed

    def block_input(self, anchor: int, anchor_pos: int, rows: int | None = None) -> PackedBlock:
        """The drafter forward's inputs for the block of `rows` positions (None: the drafter's block) anchored at
        `anchor_pos`, its new context included. A block shorter than the trained one drafts fewer positions for
        proportionally less work; its rows see fewer mask positions, so their logits are close, not equal."""
        assert self._pending is not None
        context, start = self._pending.joined(), self._pending.start
        if start + context.shape[0] != anchor_pos:
            raise RuntimeError(f"drafter context ends at {start + context.shape[0]}, anchor at {anchor_pos}")
        dev, n = self.device, rows or self.block
        ids = torch.full((n,), self.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = anchor
        embeds = embed_rows(self.embedding, ids)  # [B, H]
        block_pos = torch.arange(anchor_pos, anchor_pos + n, device=dev)  # [B]
        ctx_pos = torch.arange(start, anchor_pos, device=dev)  # [C]
        return PackedBlock(embeds, context, block_pos, ctx_pos, self._cache)

    def embed_ids(self, ids: list[int]) -> torch.Tensor:
        """Raw embedding rows [len(ids), H] of the target's table (any in-model scale bypassed)."""
        return embed_rows(self.embedding, torch.tensor(ids, device=self.device))

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, Vd] from draft states [n, H] (the target's head, restricted; soft-capped if it is)."""
        with torch.inference_mode():
            if self.packed_head is not None:
                logits = self.packed_head(states.float())
            else:
                logits = states.to(self.head_t.dtype) @ self.head_t
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _consumed(self, anchor_pos: int) -> None:
        """The pending context went into the drafter cache with the block at `anchor_pos`."""
        assert self._pending is not None
        self._pending.consumed(anchor_pos)

    def to_target(
        self, ids: torch.Tensor, q_small: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocabulary ids (and q over it, [n, Vd]) -> target ids (and q over the target vocabulary)."""
        vocab = self.draft_vocab
        if vocab is None:
            return ids, q_small
        if q_small is None:
            return vocab[ids], None
        q = torch.zeros(q_small.shape[0], self.vocab_size, device=q_small.device)
        q[:, vocab] = q_small
        return vocab[ids], q

    def ids_to_target(self, ids: list[int]) -> list[int]:
        """Host-side draft-vocabulary ids -> target ids (trees are built on the host)."""
        if self.draft_vocab is None:
            return ids
        if self._vocab_host is None:
            self._vocab_host = self.draft_vocab.tolist()
        return [self._vocab_host[i] for i in ids]

    def chain_from_logits(self, logits: torch.Tensor) -> Draft:
        """A chain from draft logits [depth, Vd]: argmax when greedy, else a draw with its q recorded. With the
        request's adjustments, each position is adjusted with the path drafted before it."""
        if self.adjust is not None:
            ids, qs = self.adjust.chain(logits, self._params, self._generator, self.draft_vocab)
            small = torch.tensor(ids, dtype=torch.long, device=logits.device)
            tokens, q = self.to_target(small, torch.stack(qs) if qs else None)
            return Draft.chain(tokens, q=q)
        if self._params.greedy:
            return Draft.chain(self.to_target(logits.argmax(-1))[0])
        q_small = process_logits(logits, self._params)  # [depth, Vd]
        tokens, q = self.to_target(sample(q_small, self._generator), q_small)
        return Draft.chain(tokens, q=q)

    def marginals(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [D, Vd] as a tree is built from them (paths unknown): adjusted per DraftAdjust.rows."""
        return logits if self.adjust is None else self.adjust.rows(logits, self.draft_vocab)

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """A chain of up to B−1 tokens after tokens[-1] (q set when sampling)."""
        depth = min(self.block_size, max_depth)
        return self.chain_from_logits(self.draft_logits(tokens[-1], len(tokens) - 1, depth))

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Queue the features of the root and the accepted tokens as new context."""
        assert target_hidden is not None and self._pending is not None
        self._pending.append(target_hidden[0])


def draft_blocks(requests: list[tuple[DFlashDrafter, int, int, int, int | None]]) -> None:
    """Draft several requests' blocks at once: (drafter fork, anchor, anchor position, depth, block rows or None
    for the drafter's block) each.

    Forks of one DFlash network share one forward (dflash_packed.py) and one pass of the head over
    every request's rows; each fork's next draft_logits call for that anchor then returns its share. With the
    packed fp32 kernels (row-invariant) the logits are bitwise those of each fork's own forward."""
    groups: dict[int, list[tuple[DFlashDrafter, int, int, int, int | None]]] = {}
    for req in requests:
        groups.setdefault(id(req[0].model), []).append(req)
    for group in groups.values():
        clock = device_clock(group[0][0].device)
        t0 = clock()
        blocks = [d.block_input(anchor, pos, n) for d, anchor, pos, _, n in group]
        with torch.inference_mode():
            states = group[0][0].runner(blocks)  # [ΣB, H]
        rows, at = [], 0
        for (_, _, _, depth, _), b in zip(group, blocks, strict=True):
            rows.append(states[at + 1 : at + 1 + depth])
            at += b.block_embeds.shape[0]
        first = group[0][0]
        if first.packed_head is not None:  # row-invariant: one head pass for every request
            logits = first.head_logits(torch.cat(rows)).split([r.shape[0] for r in rows])
        else:  # a library matmul is not row-invariant: each request's rows alone, as its own forward does
            logits = [d.head_logits(r) for (d, *_), r in zip(group, rows, strict=True)]
        share = (clock() - t0) / len(group)
        for (d, _, pos, _, _), lg, st in zip(group, logits, rows, strict=True):
            d._consumed(pos)
            d._prefetched = (pos, lg, st, share)
