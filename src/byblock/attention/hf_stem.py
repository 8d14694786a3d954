"""Stem inside any transformers decoder, through the official custom-attention hooks.

`enable_stem(model, cfg)` registers the attention function "byblock_stem" in transformers'
AttentionInterface **and** the SDPA mask builder under the same name in AttentionMaskInterface (without the
latter, transformers hands custom attention `attention_mask=None` and padding is lost — the trap of the
reference note §5), stores the config and a density log on the model's config (per model, no globals) and
switches the model to it. Prefill of a long enough prompt runs sparse on global-attention layers from
`dense_layers` on; decode steps, cached continuations, short prompts and sliding-window layers call SDPA.
"""

from __future__ import annotations

import logging

import torch

from byblock.attention.sparse_decode import sparse_decode_attention
from byblock.attention.stem import (
    Backend,
    DensityLog,
    StemConfig,
    block_sparse_attention,
    block_sparse_attention_flex,
    causal_density,
    oam_block_logits,
    select_blocks,
    tpd_budgets,
)
from byblock.kernels.ragged import BATCH_KWARG, CACHE_KWARG, PROMPT_KWARG

log = logging.getLogger(__name__)

NAME = "byblock_stem"
WARN_SPARSITY = 0.85  # seed 000's pitfalls table: beyond this, retrieval quality falls off


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def stem_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention signature: query [B, H, Lq, D], key/value [B, Hkv, Lk, D] -> ([B, Lq, H, D], None)."""
    if (batch := kwargs.pop(BATCH_KWARG, None)) is not None:  # a packed batch: per sequence, its own cache
        return batch.attend(stem_attention_forward, module, query, key, value, scaling=scaling, **kwargs)
    cache = kwargs.pop(CACHE_KWARG, None)  # the rows' KVCache: it keeps sparse decode's block summaries
    cfg: StemConfig | None = getattr(module.config, "byblock_stem", None)
    density: DensityLog | None = getattr(module.config, "byblock_stem_log", None)
    _, h, lq, d = query.shape
    lk = key.shape[2]
    layer = getattr(module, "layer_idx", 0)
    window = getattr(module, "sliding_window", None)
    decoded = _sparse_decode_rows(module, query, key, value, attention_mask, scaling, cache, kwargs)
    if decoded is not None:
        return decoded, None
    sparse = (
        cfg is not None
        and cfg.prefill
        and lq == lk  # a first prefill: query i aligns with key i
        and lq >= max(cfg.min_tokens, 2 * cfg.block_size)
        and layer >= cfg.dense_layers
        and getattr(module, "sliding_window", None) is None
    )
    if (
        cfg is not None
        and density is not None
        and window is not None
        and cfg.backend is Backend.FLEX
        and lq == lk >= cfg.min_tokens
        and _unpadded(attention_mask)  # checked last: only long first prefills pay for it
    ):
        # a sliding-window layer stays exact, but skips the blocks outside its window instead of masking them
        scale = scaling if scaling is not None else d**-0.5
        groups = h // key.shape[1]
        out = sliding_window_flex(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), window, scale, density
        )
        density.per_layer[layer] = 1.0
        density.window_layers.add(layer)
        return out.transpose(1, 2).contiguous(), None
    if not sparse:
        if cfg is not None and cfg.prefill and density is not None and lq == lk and lq > 1:
            density.per_layer[layer] = 1.0
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else d**-0.5
    groups = h // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    bs = cfg.block_size
    main = (lq // bs) * bs
    key_valid = None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        key_valid = attention_mask[:, 0].any(dim=-2)  # [B, Lk]: keys some query may see (padding excluded)
    q, k, v = query[:, :, :main], key[:, :, :main], value[:, :, :main]
    if key_valid is not None:
        k = k.masked_fill(~key_valid[:, None, :main, None], 0.0)  # padded keys score nothing in the estimate
    mask = _block_mask(q, k, v, cfg, scale, layer, density)
    if density is not None:
        density.per_layer[layer] = causal_density(mask)
        density.kernel_layers.add(layer)
    valid = None if key_valid is None or bool(key_valid.all()) else key_valid[:, :main]
    if cfg.backend is Backend.FLEX and valid is None:
        out = block_sparse_attention_flex(q, k, v, mask, bs, scale, density if density is not None else DensityLog())
    else:  # the gather kernel also handles padding
        out = block_sparse_attention(q, k, v, mask, bs, scale, key_valid=valid)
    if main < lq:  # the last partial block of queries attends densely (a few rows)
        tail_mask = None if attention_mask is None else attention_mask[:, :, main:, :]
        if tail_mask is None:
            tail_mask = torch.ones(lq - main, lk, dtype=torch.bool, device=query.device).tril(diagonal=main)[None, None]
        tail = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, main:], key, value, attn_mask=tail_mask, scale=scale
        )
        out = torch.cat([out, tail], dim=2)
    return out.transpose(1, 2).contiguous(), None


def sparse_decode_config(config) -> StemConfig | None:
    """The model config's StemConfig when `--sparse-decode` is on (decode and verify rows sparse), else None."""
    cfg: StemConfig | None = getattr(config, "byblock_stem", None)
    return cfg if cfg is not None and cfg.decode_blocks > 0 else None


def _sparse_decode_rows(module, query, key, value, attention_mask, scaling, cache, kwargs) -> torch.Tensor | None:
    """[B, Lq, H, D] when `--sparse-decode` covers these rows (decoded or verified rows of a global-attention
    layer from `dense_layers` on), else None. Prompt chunks (chunked prefill, a cached continuation) attend
    densely, so a chunked prompt stays bitwise one prefill (kernels/ragged.py PROMPT_KWARG)."""
    cfg = sparse_decode_config(module.config)
    layer = getattr(module, "layer_idx", 0)
    decode = query.shape[2] < key.shape[2] and not kwargs.get(PROMPT_KWARG, False)
    if cfg is None or not decode or layer < cfg.dense_layers:
        return None
    if getattr(module, "sliding_window", None) is not None:
        return None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = attention_mask if attention_mask is None or attention_mask.dim() == 4 else None
    summary = cache.key_summary(layer, cfg.block_size) if cache is not None else None
    out, frac = sparse_decode_attention(
        query,
        key,
        value,
        mask,
        scale,
        cfg.block_size,
        cfg.decode_blocks,
        cfg.decode_window,
        cfg.sink_blocks,
        summary,
        min_position=cfg.decode_min_tokens,
    )
    density: DensityLog | None = getattr(module.config, "byblock_stem_log", None)
    if density is not None:
        density.decode[layer] = frac
    return out.transpose(1, 2).contiguous()


def sparse_decode_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Sparse decode inside byblock's own decoder forward (models/adapter.py): decode and verify rows as in
    `stem_attention_forward`, every other row through byblock's dense kernel (kernels/gqa_sdpa.py), so a model
    with `--sparse-decode` and no sparse prefill keeps the decoder's speed and its prompts' bits."""
    from byblock.kernels.gqa_sdpa import gqa_sdpa_attention_forward

    if (batch := kwargs.pop(BATCH_KWARG, None)) is not None:
        return batch.attend(sparse_decode_forward, module, query, key, value, scaling=scaling, **kwargs)
    cache = kwargs.pop(CACHE_KWARG, None)
    cfg = sparse_decode_config(module.config)
    # Every row at a position below decode_min_tokens: the dense kernel, when it is the row kernel (CPU, fp32),
    # which gives such a row the bits the sparse path gives it (all its visible keys, in slot order), so a
    # verify that straddles the threshold still matches its decode steps. Elsewhere the sparse path decides.
    short = cfg is not None and key.shape[2] <= cfg.decode_min_tokens and _row_kernel_runs(query)
    decoded = None if short else _sparse_decode_rows(module, query, key, value, attention_mask, scaling, cache, kwargs)
    if decoded is not None:
        return decoded, None
    return gqa_sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _row_kernel_runs(query: torch.Tensor) -> bool:
    """Whether decode rows of this dtype and device run on the CPU row kernel (kernels/row_attention.py)."""
    if query.dtype != torch.float32 or not query.is_cpu:
        return False
    from byblock.kernels.row_attention import load_row_attention

    return load_row_attention() is not None


def _block_mask(q, k, v, cfg: StemConfig, scale: float, layer: int, density: DensityLog | None) -> torch.Tensor:
    """This layer's selected blocks [B, H, n, n]: scored here, or the mask its index group chose earlier in
    this forward (--sparse-share-layers N > 1 skips the OAM scoring and top-k in N-1 of every N sparse layers)."""
    n = q.shape[2] // cfg.block_size
    group = cfg.index_group(layer)
    if cfg.share_layers > 1 and density is not None:
        mask = density.lookup(group, layer, torch.Size((q.shape[0], q.shape[1], n, n)))
        if mask is not None:
            density.shared_layers.add(layer)
            return mask
    mask = select_blocks(oam_block_logits(q, k, v, cfg, scale), tpd_budgets(n, cfg), cfg)
    if cfg.share_layers > 1 and density is not None:
        density.shared = (group, layer, mask)
    return mask


def _unpadded(attention_mask: torch.Tensor | None) -> bool:
    """True when no key is padding (every key column is visible to some query)."""
    if attention_mask is None:
        return True
    return attention_mask.dtype == torch.bool and bool(attention_mask[:, 0].any(dim=-2).all())


def sliding_window_flex(q, k, v, window: int, scale: float, log: DensityLog):
    """Exact causal sliding-window attention (query i sees keys i-window+1..i) with flex_attention, so the
    key blocks outside the window are skipped rather than masked. q, k, v: [B, H, L, D] -> [B, H, L, D]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if log.flex is None:
        log.flex = torch.compile(flex_attention, dynamic=False)
    length = q.shape[2]

    def in_window(b, h, qi, kv):
        return (qi >= kv) & (qi - kv < window)

    block_mask = create_block_mask(in_window, None, None, length, length, device=q.device)
    return log.flex(q, k, v, block_mask=block_mask, scale=scale)


def enable_stem(hf_model: torch.nn.Module, cfg: StemConfig) -> DensityLog:
    """Switch a loaded transformers model to Stem prefill; returns the per-layer density log it fills."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, stem_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if cfg.sparsity > WARN_SPARSITY:
        log.warning(
            "sparsity %.2f > %.2f: long-context retrieval quality usually drops here", cfg.sparsity, WARN_SPARSITY
        )
    density = DensityLog()
    for conf in {id(c): c for c in (hf_model.config, hf_model.config.get_text_config())}.values():
        conf.byblock_stem = cfg
        conf.byblock_stem_log = density
    hf_model.set_attn_implementation(NAME)
    return density
