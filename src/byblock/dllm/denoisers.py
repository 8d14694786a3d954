"""Diffusion models behind one interface: a per-request Session that denoises a canvas and commits blocks.

A Session owns the request's KV cache. `denoise` runs the canvas bidirectionally against everything
committed and never writes the cache; `commit` writes a finished block with one pass (the exact block KV
cache of BD3-LM / Fast-dLLM v2 / DiffusionGemma's encoder). CacheMode.NONE recomputes the whole prefix in
every denoise call instead — the reference the cached path is tested against.

Two families:
- MaskDenoiser: any transformers causal LM used as a mask-absorbing diffusion model (LLaDA / Fast-dLLM v2
  style, and byblock's puzzle models): the prompt is causal, each committed block and the canvas are
  bidirectional inside and see everything before them (block-causal).
- GemmaDenoiser: transformers' DiffusionGemma (uniform-state; causal encoder writes the cache, the decoder
  reads it bidirectionally, self-conditioning on the previous step's logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from byblock.dllm.config import CacheMode
from byblock.errors import ByblockError
from byblock.kv.kv_cache import KVCache


class Session(Protocol):
    """One request's view of a diffusion model."""

    length: int  # committed tokens (prompt + finished blocks)
    device: torch.device  # the model's: the canvas and every per-step tensor are made here

    def denoise(self, canvas: torch.Tensor, self_cond: torch.Tensor | None) -> torch.Tensor:
        """canvas [B, L] -> logits [B, L, V] (float32); reads, never writes, the committed context."""
        ...

    def commit(self, block: torch.Tensor) -> None:
        """Append a finished block [B, L] to the committed context."""
        ...


class Denoiser(Protocol):
    """A diffusion model byblock can decode."""

    vocab_size: int
    device: torch.device  # where the weights live: every per-request tensor is made here
    mask_token_id: int | None  # None: a uniform-state model (renoise sampler only)
    default_block_size: int
    uses_self_conditioning: bool

    def session(self, prompt_ids: torch.Tensor, cache: CacheMode) -> Session:
        """Commit the prompt [B, P] and return the request's session."""
        ...


@dataclass
class _Segment:
    tokens: torch.Tensor  # [B, T]
    bidirectional: bool


def segment_mask(
    segments: list[tuple[int, bool]], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive [1, 1, T, T] mask on `device` for consecutive segments (length, bidirectional): a token sees every
    earlier segment, and inside its own segment either everything (bidirectional) or only what precedes it."""
    seg_id = torch.cat([torch.full((n,), i, device=device) for i, (n, _) in enumerate(segments)])
    bidi = torch.tensor([b for _, b in segments], device=device)[seg_id]  # [T]
    t = seg_id.numel()
    pos = torch.arange(t, device=device)
    earlier = seg_id[None, :] < seg_id[:, None]
    same = seg_id[None, :] == seg_id[:, None]
    ok = earlier | (same & (bidi[:, None] | (pos[None, :] <= pos[:, None])))
    return torch.zeros(t, t, dtype=dtype, device=device).masked_fill(~ok, torch.finfo(dtype).min)[None, None]


class MaskDenoiser:
    """A transformers causal LM used as a mask-absorbing, block-causal diffusion model."""

    uses_self_conditioning = False

    def __init__(
        self,
        hf_model: torch.nn.Module,
        mask_token_id: int,
        block_size: int,
        full_bidirectional: bool = False,
        shift: bool = False,
    ) -> None:
        """full_bidirectional: LLaDA-style, every position (the prompt too) attends to every other; then no
        block cache is exact and CacheMode.PREFIX is Fast-dLLM's approximate prefix cache.
        shift: the logits at position i − 1 predict token i (Dream / Fast-dLLM v2: a model converted from an
        AR one keeps its next-token head), so a canvas's first token is read off the last committed row."""
        if shift and full_bidirectional:
            raise ValueError("shifted logits need a block-causal model")
        self.hf = hf_model.eval()
        self.mask_token_id = mask_token_id
        self.default_block_size = block_size
        self.full_bidirectional = full_bidirectional
        self.shift = shift
        self.vocab_size = int(hf_model.config.get_text_config().vocab_size)
        self.dtype = next(hf_model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        """Where the weights are now (read per request, so a model moved after wrapping is followed)."""
        return next(self.hf.parameters()).device

    def session(self, prompt_ids: torch.Tensor, cache: CacheMode) -> _MaskSession:
        """Commit the prompt (causal) and return the request's session."""
        return _MaskSession(self, prompt_ids, cache)


class _MaskSession:
    def __init__(self, model: MaskDenoiser, prompt_ids: torch.Tensor, cache: CacheMode) -> None:
        from byblock.errors import InvalidParameterError

        if model.full_bidirectional and cache is CacheMode.EXACT:
            raise InvalidParameterError(
                "a fully bidirectional model has no exact block cache: use --cache none (exact) or prefix (approximate)"
            )
        if not model.full_bidirectional and cache is CacheMode.PREFIX:
            cache = CacheMode.EXACT  # block-causal: the prefix never sees the canvas, so its cache is exact
        self.m = model
        self.device = model.device  # the request's tensors live with the weights
        self.mode = cache
        self.segments = [_Segment(prompt_ids, bidirectional=model.full_bidirectional)]
        self.length = prompt_ids.shape[1]
        self.cache = KVCache(device=self.device)
        self.block_started = False  # PREFIX: the prefix K/V of the current block are cached
        self.last: torch.Tensor | None = None  # shift + EXACT: the last committed row's logits [B, 1, V]
        if cache is CacheMode.EXACT:
            logits = self._forward(prompt_ids, self.cache.hf, start=0, mask=None)
            self.last = logits[:, -1:]

    def _forward(self, ids: torch.Tensor, cache, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        pos = torch.arange(start, start + ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        return self.m.hf(input_ids=ids, cache=cache, position_ids=pos, attention_mask=mask, use_cache=True).logits

    def _bidi_mask(self, past: int, t: int) -> torch.Tensor:
        # all of the past plus the whole block
        return torch.zeros(1, 1, t, past + t, dtype=self.m.dtype, device=self.device)

    @torch.inference_mode()
    def denoise(self, canvas: torch.Tensor, self_cond: torch.Tensor | None) -> torch.Tensor:
        """Canvas logits; EXACT reads the cache and crops what it appended, NONE recomputes everything."""
        if self.mode is CacheMode.EXACT:
            past = self.cache.length
            logits = self._forward(canvas, self.cache.hf, past, self._bidi_mask(past, canvas.shape[1]))
            self.cache.crop(past)
            if self.m.shift:
                assert self.last is not None
                logits = torch.cat([self.last, logits[:, :-1]], dim=1)
            return logits.float()
        if self.mode is CacheMode.PREFIX and self.block_started:
            past = self.cache.length  # stale prefix K/V: computed when the block started
            logits = self._forward(canvas, self.cache.hf, past, self._bidi_mask(past, canvas.shape[1]))
            self.cache.crop(past)
            return logits.float()
        segs = [*self.segments, _Segment(canvas, bidirectional=True)]
        ids = torch.cat([s.tokens for s in segs], dim=1)
        if self.m.full_bidirectional:
            mask = torch.zeros(1, 1, ids.shape[1], ids.shape[1], dtype=self.m.dtype, device=self.device)
        else:
            mask = segment_mask([(s.tokens.shape[1], s.bidirectional) for s in segs], self.m.dtype, self.device)
        fresh = KVCache(device=self.device)
        logits = self._forward(ids, fresh.hf, 0, mask)
        b = canvas.shape[1]
        logits = (logits[:, -b - 1 : -1] if self.m.shift else logits[:, -b:]).float()
        if self.mode is CacheMode.PREFIX:  # keep the prefix K/V of this full pass for the block's later steps
            fresh.crop(self.length)
            self.cache, self.block_started = fresh, True
        return logits

    @torch.inference_mode()
    def commit(self, block: torch.Tensor) -> None:
        """One bidirectional-within-block pass writes the block's K/V (EXACT); NONE just remembers it."""
        if self.mode is CacheMode.EXACT:
            past = self.cache.length
            logits = self._forward(block, self.cache.hf, past, self._bidi_mask(past, block.shape[1]))
            self.last = logits[:, -1:]
        self.segments.append(_Segment(block, bidirectional=True))
        self.length += block.shape[1]
        self.block_started = False


class GemmaDenoiser:
    """transformers' DiffusionGemmaForBlockDiffusion behind the Session interface."""

    mask_token_id = None
    uses_self_conditioning = True

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf = hf_model.eval()
        self.default_block_size = int(hf_model.config.canvas_length)
        self.vocab_size = int(hf_model.config.get_text_config().vocab_size)

    @property
    def device(self) -> torch.device:
        """Where the weights are now (read per request, so a model moved after wrapping is followed)."""
        return next(self.hf.parameters()).device

    def session(self, prompt_ids: torch.Tensor, cache: CacheMode) -> _GemmaSession:
        """Encode the prompt causally into a fresh cache (EXACT) and return the request's session."""
        return _GemmaSession(self, prompt_ids, cache)


class _GemmaSession:
    def __init__(self, model: GemmaDenoiser, prompt_ids: torch.Tensor, cache: CacheMode) -> None:
        cache = CacheMode.EXACT if cache is CacheMode.PREFIX else cache  # a causal encoder's prefix is exact
        self.m = model
        self.device = model.device  # the request's tensors live with the weights
        self.mode = cache
        self.committed = prompt_ids
        self.length = prompt_ids.shape[1]
        self.cache = self._new_cache()
        if cache is CacheMode.EXACT:
            self._encode(self.cache, prompt_ids, 0)

    def _new_cache(self):
        from transformers import DynamicCache

        with torch.device(self.device):  # its sliding layers make a bookkeeping tensor with no device argument
            return DynamicCache(config=self.m.hf.config.get_text_config(decoder=True))

    def _encode(self, cache, ids: torch.Tensor, start: int) -> None:
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        self.m.hf.model.encoder(input_ids=ids, cache=cache, position_ids=pos)

    @torch.inference_mode()
    def denoise(self, canvas: torch.Tensor, self_cond: torch.Tensor | None) -> torch.Tensor:
        """Decoder pass over the canvas (reads the cache; NONE first re-encodes everything committed)."""
        cache = self.cache
        if self.mode is CacheMode.NONE:
            cache = self._new_cache()
            self._encode(cache, self.committed, 0)
        pos = torch.arange(self.length, self.length + canvas.shape[1], device=self.device)[None]
        out = self.m.hf(
            decoder_input_ids=canvas, cache=cache, self_conditioning_logits=self_cond, decoder_position_ids=pos
        )
        return out.logits.float()

    @torch.inference_mode()
    def commit(self, block: torch.Tensor) -> None:
        """The encoder's causal pass over the finished canvas writes its K/V."""
        if self.mode is CacheMode.EXACT:
            self._encode(self.cache, block, self.length)
        self.committed = torch.cat([self.committed, block], dim=1)
        self.length += block.shape[1]


def as_denoiser(hf_model: torch.nn.Module, mask_token_id: int | None = None, block_size: int | None = None) -> Denoiser:
    """Wrap a loaded transformers model: DiffusionGemma as is, any causal LM given a mask token and block size."""
    if type(hf_model).__name__.startswith("DiffusionGemma"):
        return GemmaDenoiser(hf_model)
    if mask_token_id is None or block_size is None:
        raise ByblockError(
            f"{type(hf_model).__name__} is not a diffusion model byblock knows: a mask-absorbing model needs "
            "byblock_dllm.json (mask_token_id, block_size) next to its weights"
        )
    return MaskDenoiser(hf_model, mask_token_id, block_size)
