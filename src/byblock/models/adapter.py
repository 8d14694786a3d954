"""TargetModel: the one interface the engine uses over any transformers causal LM.

Responsibilities: prefill and multi-token forwards with explicit positions and an optional tree mask,
KV caches that can be cropped and compacted, and capture of hidden states at chosen layers from the
same forward (block drafters need them). Not here: decoding policy (engine/), acceptance (verify/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from byblock.attention.hf_stem import NAME as STEM
from byblock.attention.hf_stem import sparse_decode_config, sparse_decode_forward
from byblock.kernels.gqa_sdpa import NAME as GQA_SDPA
from byblock.kernels.gqa_sdpa import gqa_sdpa_attention_forward
from byblock.kernels.invariant import NAME as INVARIANT_ATTENTION
from byblock.kernels.invariant import ROW_CHUNK, RowPlan
from byblock.kernels.ragged import BATCH_KWARG, CACHE_KWARG, PROMPT_KWARG, PackedBatch, Segment
from byblock.kernels.row_attention import load_row_attention
from byblock.kv.h2o import H2OState, tree_parents
from byblock.kv.kv_cache import KVCache, StreamingWindow
from byblock.models.decoder import DecoderForward, DecoderOps
from byblock.models.masks import tree_attention_mask


@dataclass(frozen=True)
class ForwardOutput:
    """Result of one target forward."""

    logits: torch.Tensor | None  # [B, T_kept, V] float; None when deferred (then `final` is set)
    hidden: torch.Tensor | None  # [B, T, k*H]: the requested layers' outputs, concatenated; None if none asked
    final: torch.Tensor | None = None  # [B, T, H]: the last layer's normed states, when logits were deferred


@dataclass(frozen=True)
class SegmentInput:
    """One sequence's new tokens in a packed forward (TargetModel.forward_packed)."""

    cache: KVCache  # the sequence's own cache; grows by len(input_ids) slots
    input_ids: list[int]
    positions: torch.Tensor | None = None  # [T] absolute RoPE positions (default: contiguous after the cache)
    tree_mask: torch.Tensor | None = None  # [T, T] bool ancestor-or-self mask of a draft tree; None = causal
    prompt: bool = False  # a prompt's rows (a prefill chunk): see TargetModel.forward's `prompt`


@dataclass(frozen=True)
class PackedOutput:
    """Result of one packed forward; rows are packed rows (segment i's rows start at offsets[i])."""

    logits: torch.Tensor  # [R, V] float: the logits of the rows asked for, in the order asked
    final: torch.Tensor | None  # [ΣT, H]: the last layer's normed states, when asked for
    hidden: torch.Tensor | None  # [ΣT, k*H]: the requested layers' outputs, concatenated
    offsets: tuple[int, ...]


def _as_id_set(value: object) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}  # type: ignore[union-attr]


class TargetModel:
    """A causal LM + tokenizer, driven token-by-token or block-by-block by the engine."""

    def __init__(
        self,
        hf_model: torch.nn.Module,
        tokenizer,
        name: str = "model",
        weights: str | None = None,
        own_forward: bool = True,
        decoder_ops: DecoderOps | None = None,
    ) -> None:
        """own_forward: run byblock's decoder forward (models/decoder.py) where it reproduces the model (llama /
        qwen3 in fp32 on byblock's attention); False keeps transformers' modules for every forward. decoder_ops:
        how that forward runs its norms and rotations (default: the row kernel on the CPU; exact=True: bitwise
        transformers')."""
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.name = name
        cfg = hf_model.config
        self.text_config = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        tc = self.text_config
        self.num_layers: int = tc.num_hidden_layers
        self.hidden_size: int = tc.hidden_size
        head = hf_model.get_output_embeddings()
        self.vocab_size: int = getattr(head, "out_features", None) or head.weight.shape[0]
        self.max_context: int = int(getattr(tc, "max_position_embeddings", 2048))
        layer_types = getattr(tc, "layer_types", None) or []
        self.sliding_window: int | None = (
            getattr(tc, "sliding_window", None) if any("sliding" in t for t in layer_types) else None
        )
        gen_cfg = getattr(hf_model, "generation_config", None)
        eos = _as_id_set(getattr(gen_cfg, "eos_token_id", None)) | _as_id_set(tc.eos_token_id)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        first = next(hf_model.parameters())
        self.dtype: torch.dtype = first.dtype
        # How the linears hold their weights, for reports: "float32", "bfloat16", "int4", "gguf (210 Q4_1, ...)".
        self.weights: str = weights or str(first.dtype).removeprefix("torch.")
        self.device: torch.device = first.device  # every per-round tensor is built here, never on a default device
        self.kv_bits: int | None = None  # 8 / 4: int8 / int4 KV cache (kv/kv_quant.py)
        self.kv_window: StreamingWindow | None = None  # StreamingLLM sinks + window (kv/kv_cache.py)
        self.snapkv = None  # SnapKVState when SnapKV is on (kv/snapkv.py)
        self.h2o = None  # H2ORuntime when H2O is on (kv/h2o.py)
        # Whether logits are exactly `head` of the decoder stack's output, so forwards may defer them: None until
        # the first forward that asks checks it on its own output (a head that scales or soft-caps logits: no).
        base = getattr(hf_model, "base_model", None)
        self._defers_logits: bool | None = None if base is not None and base is not hf_model else False
        supported = own_forward and DecoderForward.supports(hf_model)
        self.decoder = DecoderForward(hf_model, decoder_ops) if supported else None
        if self.decoder is not None:
            self._defers_logits = True  # llama / qwen3 logits are the plain head of the normed final states

    @property
    def row_invariant(self) -> bool:
        """Whether decode/verify forwards run the row-invariant kernels (kernels/invariant.py) — not when
        another attention function (Stem, H2O, SnapKV) has replaced them since."""
        cfg = self.hf.config
        return hasattr(cfg, "byblock_row_invariance") and cfg._attn_implementation == INVARIANT_ATTENTION

    def defers_logits(self) -> bool:
        """Whether logits are exactly `head` of the final normed states, so the head may run on chosen rows only
        (checked once, on a one-token probe forward, when no forward has checked it yet)."""
        if self._defers_logits is None:
            probe = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            self.forward(probe, KVCache(device=self.device), defer_logits=True)
        return bool(self._defers_logits)

    @property
    def _decoder_runs(self) -> bool:
        """Whether byblock's decoder forward can run now: it exists and attention is still byblock's kernel (Stem
        and the bf16 row-invariant attention swap transformers' attention function), or Stem is on for
        `--sparse-decode` alone (no sparse prefill), which the decoder runs through `sparse_decode_forward`."""
        if self.decoder is None:
            return False
        impl = self.hf.config._attn_implementation
        decode_only = (sparse := sparse_decode_config(self.hf.config)) is not None and not sparse.prefill
        return impl == GQA_SDPA or (impl == STEM and decode_only)

    @property
    def _decoder_attention(self):
        """The attention function byblock's decoder forward calls (dense, or sparse decode beside dense)."""
        return sparse_decode_forward if self.hf.config._attn_implementation == STEM else gqa_sdpa_attention_forward

    def _tree_mask(self, past, positions, tree_mask, cache_pos=None, window=None):
        """models/masks.py's tree_attention_mask for this model's dtype, device and sliding window."""
        return tree_attention_mask(
            past, positions, tree_mask, self.dtype, self.device, self.sliding_window, cache_pos, window
        )

    def _own_forward_applies(self, cache: KVCache) -> bool:
        """Whether byblock's decoder forward computes this cache's forward exactly (no KV policy that hooks
        transformers' modules: StreamingLLM, H2O, SnapKV)."""
        return (
            self._decoder_runs
            and cache.window is None
            and cache.h2o is None
            and self.h2o is None
            and self.snapkv is None
        )

    def _own_forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None,
        logits_to_keep: int,
        hidden_layers: tuple[int, ...],
        defer_logits: bool,
        prompt: bool,
    ) -> ForwardOutput:
        """`forward` through models/decoder.py: the same masks, cache appends and attention kernel."""
        t = input_ids.shape[1]
        if tree_mask is None and (t == 1 or cache.length == 0):
            mask = None  # what transformers' SDPA mask gives: one query, or a causal prefill with no past
        else:
            mask = self._segment_masks(cache, positions[0], tree_mask)["full_attention"]
        cache.record(positions[0])
        extra: dict = {PROMPT_KWARG: True} if prompt else {}
        if sparse_decode_config(self.hf.config) is not None:  # it keeps its block summaries in the cache
            extra[CACHE_KWARG] = cache
        fn = self._decoder_attention

        def attend(module, q, k, v):
            k, v = cache.append(module.layer_idx, k, v)
            return fn(module, q, k, v, mask, scaling=module.scaling, **extra)[0]

        assert self.decoder is not None
        final, layers = self.decoder(input_ids, positions, attend, hidden_layers)
        hidden = torch.cat([layers[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        if defer_logits:
            return ForwardOutput(logits=None, hidden=hidden, final=final)
        return ForwardOutput(logits=self.head(final[:, -logits_to_keep:] if logits_to_keep else final), hidden=hidden)

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer carries a chat template (instruct models)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """Token ids for a prompt; with `chat`, wrapped in the model's chat template as one user turn."""
        if chat and self.has_chat_template:
            enc = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation (role/content dicts) in the chat template, ready for the next answer."""
        if not self.has_chat_template:
            text = "".join(m["content"] + "\n" for m in messages)
            return [int(t) for t in self.tokenizer(text, add_special_tokens=True)["input_ids"]]
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
        return [int(t) for t in ids]

    def new_cache(self) -> KVCache:
        """An empty KV cache for one sequence batch (quantized when `kv_bits` is set)."""
        per_head = H2OState(self.h2o.cfg) if self.h2o is not None else None
        return KVCache(self.kv_bits, self.kv_window, per_head, device=self.device)

    def _windowed_prefill(
        self, input_ids: torch.Tensor, cache: KVCache, logits_to_keep: int, hidden_layers: tuple[int, ...]
    ) -> ForwardOutput:
        """A long input under a StreamingLLM window, in chunks of `window` tokens with eviction between them.

        Every query still sees exactly its sinks + window (the cache before a chunk holds the sinks and the
        window − 1 newest slots), but attention costs O(T · window) instead of O(T²) over an explicit [T, T]
        mask, and the cache never grows past sinks + 2 · window."""
        assert cache.window is not None
        step = cache.window.window
        chunks = list(torch.split(input_ids, step, dim=1))
        need_all = logits_to_keep == 0 or logits_to_keep > chunks[-1].shape[1]
        logits, hidden = [], []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            cache.evict()
            keep = 0 if need_all else (logits_to_keep if last else 1)  # 1: the least transformers computes
            out = self.forward(chunk, cache, logits_to_keep=keep, hidden_layers=hidden_layers, prompt=True)
            if need_all or last:
                logits.append(out.logits)
            if out.hidden is not None:
                hidden.append(out.hidden)
        merged = torch.cat(logits, dim=1)
        if logits_to_keep:
            merged = merged[:, -logits_to_keep:]
        return ForwardOutput(logits=merged, hidden=torch.cat(hidden, dim=1) if hidden else None)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        hidden_layers: tuple[int, ...] = (),
        defer_logits: bool = False,
        prompt: bool = False,
    ) -> ForwardOutput:
        """Run new tokens through the model, appending their K/V to `cache`.

        Args:
            input_ids: [B, T] new tokens.
            cache: holds the K/V of everything before them; grows by T slots.
            positions: [B, T] RoPE positions (default: contiguous after the cache). Trees pass depth-based ones.
            tree_mask: [T, T] bool ancestor-or-self mask for a draft tree (batch 1); None = causal.
            attention_mask: [B, past+T] 0/1 padding mask for batched prefill/decode (None = no padding).
            logits_to_keep: compute logits for only the last n positions (0 = all).
            hidden_layers: decoder layer indices whose outputs to return (DFlash indexing: layer i -> i+1).
            defer_logits: return the last layer's normed states (`final`) and no logits, where the model's
                logits are exactly `head` of them (`defers_logits`); the caller runs `head` on the rows it
                reads (verify/rows.py). Elsewhere the logits are computed as usual.
            prompt: these rows are (a chunk of) a prompt: with a cached past they keep SDPA's aligned tiles, so
                a chunked prompt is bitwise its one-forward prefill. Other rows with a past (decode steps,
                verifies) run the row-local kernel on the CPU in fp32 (kernels/row_attention.py), so a verified
                token gets bitwise its plain decode step's attention. Rows without a past are always a prompt.
        """
        past = cache.length
        bsz, t = input_ids.shape
        w = cache.window
        if w is not None and tree_mask is None and positions is None and t > w.window and bsz == 1:
            return self._windowed_prefill(input_ids, cache, logits_to_keep, hidden_layers)
        if positions is None:
            start = cache.next_position
            positions = torch.arange(start, start + t, device=self.device).expand(bsz, t)
        if bsz == 1 and attention_mask is None and self._own_forward_applies(cache):
            return self._own_forward(
                input_ids, cache, positions, tree_mask, logits_to_keep, hidden_layers, defer_logits, prompt
            )
        mask: object = attention_mask
        if cache.window is not None:
            if bsz != 1 or attention_mask is not None:
                raise ValueError("a StreamingLLM cache decodes one sequence at a time")
            causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril() if tree_mask is None else tree_mask
            mask = self._tree_mask(past, positions[0], causal, cache.pos, cache.window)
        elif tree_mask is not None:
            mask = self._tree_mask(past, positions[0], tree_mask, cache.pos)
        if self.h2o is not None:  # the H2O attention function walks the new tokens itself (kv/h2o.py)
            if cache.h2o is not None and (bsz != 1 or attention_mask is not None):
                raise ValueError("an H2O cache decodes one sequence at a time")
            self.h2o.active = cache.h2o
            self.h2o.positions = positions[0]
            self.h2o.parents = tree_parents(tree_mask) if tree_mask is not None else None
        if self.row_invariant:  # kernels/invariant.py: how each row splits its keys, for every layer
            visible = torch.ones(t, t, dtype=torch.bool, device=self.device).tril() if tree_mask is None else tree_mask
            self.hf.config.byblock_row_invariance.plan = RowPlan.build(past, visible) if past > 0 else None
        cache.record(positions[0])
        kwargs = {"input_ids": input_ids, "cache": cache.hf, "position_ids": positions, "attention_mask": mask}
        if prompt:
            kwargs[PROMPT_KWARG] = True
        if sparse_decode_config(self.hf.config) is not None:
            kwargs[CACHE_KWARG] = cache
        defer = defer_logits and self._defers_logits is True
        check = defer_logits and self._defers_logits is None
        if defer:  # the decoder stack alone; the caller applies `head` to the rows it reads
            out = self.hf.base_model(**kwargs, use_cache=True, output_hidden_states=bool(hidden_layers))
        else:
            out = self.hf(
                **kwargs,
                use_cache=True,
                logits_to_keep=logits_to_keep,
                output_hidden_states=bool(hidden_layers) or check,
            )
        if check:  # the last hidden state is the normed one the head reads
            kept = out.hidden_states[-1][:, -out.logits.shape[1] :]
            self._defers_logits = bool(torch.equal(self.head(kept), out.logits))
        if self.snapkv is not None and self.snapkv.selections:  # a prefill just chose what to keep
            from byblock.kv.snapkv import apply_selection

            apply_selection(cache, self.snapkv)
        hidden = None
        if hidden_layers:
            hidden = torch.cat([out.hidden_states[i + 1] for i in hidden_layers], dim=-1)
        if defer:
            return ForwardOutput(logits=None, hidden=hidden, final=out.last_hidden_state)
        return ForwardOutput(logits=out.logits, hidden=hidden)

    def _segment_masks(
        self, cache: KVCache, positions: torch.Tensor, tree_mask: torch.Tensor | None
    ) -> dict[str, torch.Tensor | None]:
        """The mask(s) these rows get in a forward of their own, per layer type (built before the cache grows)."""
        if tree_mask is not None:
            mask = self._tree_mask(cache.length, positions, tree_mask, cache.pos)
            return mask if isinstance(mask, dict) else {"full_attention": mask}
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        tc = self.text_config
        embeds = torch.empty(1, positions.numel(), 1, dtype=self.dtype, device=self.device)  # shape/dtype only
        kwargs = {"config": tc, "inputs_embeds": embeds, "attention_mask": None, "cache": cache.hf}
        kwargs["position_ids"] = positions[None]
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if "sliding_attention" in (getattr(tc, "layer_types", None) or ()):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    @torch.inference_mode()
    def forward_packed(
        self,
        segments: list[SegmentInput],
        logits_rows: list[int],
        *,
        hidden_layers: tuple[int, ...] = (),
        keep_final: bool = False,
    ) -> PackedOutput:
        """Several sequences' new tokens in one forward, each against its own cache (kernels/ragged.py).

        Every linear runs once over all ΣT rows; attention runs per sequence on exactly what a forward of that
        sequence alone would compute, so with row-invariant linears each row's values are bitwise those of the
        sequence's own `forward`. logits_rows: packed rows whose logits to compute (the LM head runs on those
        only); keep_final: also return every row's normed final state (for `head` on more rows later).
        Plain caches only: StreamingLLM, H2O and SnapKV caches decode one sequence at a time."""
        if getattr(self.text_config, "use_bidirectional_attention", False):
            raise ValueError("packed forwards support causal models only")
        if len(segments) == 1:  # the same numbers by the plain path, without the per-request split's overhead
            return self._forward_one(segments[0], logits_rows, hidden_layers, keep_final)
        if self.snapkv is not None or any(s.cache.window is not None or s.cache.h2o is not None for s in segments):
            raise ValueError("packed forwards need plain KV caches (no StreamingLLM, H2O or SnapKV)")
        dev = self.device
        parts, plan, pos, start = [], [], [], 0
        invariant = self.row_invariant
        for seg in segments:
            cache, t = seg.cache, len(seg.input_ids)
            p = seg.positions
            if p is None:
                first = cache.next_position
                p = torch.arange(first, first + t, device=dev)
            masks = self._segment_masks(cache, p, seg.tree_mask)
            row_plan = None
            if invariant and cache.length > 0:
                visible = seg.tree_mask
                if visible is None:
                    visible = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
                row_plan = RowPlan.build(cache.length, visible)
            cache.record(p)
            plan.append(Segment(cache, start, start + t, masks, row_plan, seg.prompt))
            parts.extend(seg.input_ids)
            pos.append(p)
            start += t
        ids = torch.tensor([parts], device=dev)
        positions = torch.cat(pos)[None]
        if invariant:  # bf16 linears: each sequence's rows in the GEMMs its own forward would use
            state = self.hf.config.byblock_row_invariance
            lone = [s.row_plan is None and s.end - s.start > ROW_CHUNK for s in plan]
            state.whole = tuple((s.start, s.end) for s, one in zip(plan, lone, strict=True) if one)
            state.rows = start
            try:
                return self._forward_segments(plan, ids, positions, logits_rows, hidden_layers, keep_final)
            finally:
                state.whole = None
        return self._forward_segments(plan, ids, positions, logits_rows, hidden_layers, keep_final)

    def _forward_segments(
        self,
        plan: list[Segment],
        ids: torch.Tensor,
        positions: torch.Tensor,
        logits_rows: list[int],
        hidden_layers: tuple[int, ...],
        keep_final: bool,
    ) -> PackedOutput:
        """The packed forward itself, over segments whose masks and caches are ready."""
        dev = self.device
        # A prepared 4D mask makes transformers skip building one over the packed rows (attention ignores it).
        skip = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev)
        keep = torch.tensor(logits_rows, dtype=torch.long, device=dev)
        with_cache = sparse_decode_config(self.hf.config) is not None
        offsets = tuple(s.start for s in plan)
        if self._decoder_runs:
            fn = self._decoder_attention
            # Decode and verify segments all in one row-local kernel call per layer, where gqa_sdpa would give
            # each of them that kernel anyway (fp32 on the CPU, no bf16 row plans, no sparse decode).
            direct = fn is gqa_sdpa_attention_forward and not with_cache and not self.row_invariant
            direct = direct and self.dtype == torch.float32 and self.device.type == "cpu"
            batch = PackedBatch(tuple(plan), with_cache, load_row_attention() if direct else None)

            def attend(module, q, k, v):
                return batch.attend(fn, module, q, k, v, scaling=module.scaling)[0]

            final, layers = self.decoder(ids, positions, attend, hidden_layers)
            hidden = torch.cat([layers[i][0] for i in hidden_layers], dim=-1) if hidden_layers else None
            return PackedOutput(self.head(final[0, keep]), final[0] if keep_final else None, hidden, offsets)
        kwargs = {BATCH_KWARG: PackedBatch(tuple(plan), with_cache)}
        out = self.hf(
            input_ids=ids,
            position_ids=positions,
            attention_mask=skip,
            use_cache=False,
            logits_to_keep=keep,
            output_hidden_states=bool(hidden_layers) or keep_final,
            **kwargs,
        )
        hidden = None
        if hidden_layers:
            hidden = torch.cat([out.hidden_states[i + 1][0] for i in hidden_layers], dim=-1)
        final = out.hidden_states[-1][0] if keep_final else None
        return PackedOutput(out.logits[0], final, hidden, offsets)

    def _forward_one(
        self, seg: SegmentInput, logits_rows: list[int], hidden_layers: tuple[int, ...], keep_final: bool
    ) -> PackedOutput:
        """forward_packed for one sequence: its own `forward` (bitwise the same rows, tests/test_batch_exact.py)."""
        ids = torch.tensor([seg.input_ids], device=self.device)
        positions = None if seg.positions is None else seg.positions[None]
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        lazy = self.defers_logits()
        out = self.forward(
            ids,
            seg.cache,
            positions=positions,
            tree_mask=seg.tree_mask,
            hidden_layers=hidden_layers,
            defer_logits=lazy,
            prompt=seg.prompt,
        )
        if out.final is not None:  # the head on the rows asked for, as the packed forward's head pass runs it
            logits, final = self.head(out.final[0, rows]), out.final[0]
        else:
            assert out.logits is not None
            logits, final = out.logits[0, rows], None
        hidden = out.hidden[0] if out.hidden is not None else None
        return PackedOutput(logits, final if keep_final else None, hidden, (0,))

    def head(self, final: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from the last layer's normed states [..., H] (the output embedding)."""
        with torch.inference_mode():
            return self.hf.get_output_embeddings()(final)
