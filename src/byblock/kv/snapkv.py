"""SnapKV: after prefill, keep per KV head only the prompt positions the last `window` prompt queries attend
to most (plus the window itself).

Scores (SnapKV, arXiv 2404.14469): softmax(q_obs · Kᵀ / √d) of the last `window` queries, summed over those
queries and averaged over the query heads of each KV group, smoothed by a 1-D max-pool (kernel `pool`) so
neighbouring tokens are kept together; the top `budget` prefix positions per KV head survive. The selection
happens once, right after prefill, from the prompt alone — plain and speculative decoding start from the same
compressed cache, so verification is exactly lossless with respect to the SnapKV model.

Integration: an attention function registered in transformers' AttentionInterface (with the SDPA mask
builder) computes the normal SDPA output and, on a first prefill, records each layer's selection; the
adapter applies it to the cache right after that forward (TargetModel.forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NAME = "byblock_snapkv"


@dataclass(frozen=True)
class SnapKVConfig:
    """SnapKV knobs (defaults as kvpress's SnapKVPress: window 64, kernel 5)."""

    budget: int = 1024  # prompt positions kept per KV head, besides the observation window
    window: int = 64
    pool: int = 5

    def __post_init__(self) -> None:
        if self.budget < 1 or self.window < 1 or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError("SnapKV needs budget, window >= 1 and an odd pooling kernel")


@dataclass
class SnapKVState:
    """Selections recorded during the last prefill, per layer: [B, Hkv, budget + window] slot indices."""

    selections: dict[int, torch.Tensor] = field(default_factory=dict)


def select_positions(query: torch.Tensor, key: torch.Tensor, cfg: SnapKVConfig, scale: float) -> torch.Tensor | None:
    """query [B, H, L, D], key [B, Hkv, L, D] of a prefill -> kept slots [B, Hkv, budget + window] (sorted),
    or None when the prompt is too short to compress."""
    b, h, length, _ = query.shape
    hkv = key.shape[1]
    prefix = length - cfg.window
    if prefix <= cfg.budget:
        return None
    groups = h // hkv
    k = key.repeat_interleave(groups, dim=1)
    obs = query[:, :, -cfg.window :]  # [B, H, w, D]
    scores = (obs @ k[:, :, :prefix].transpose(-1, -2)) * scale  # [B, H, w, prefix]
    # each observation query also sees the window keys before it; softmax over all it can see
    win = (obs @ k[:, :, prefix:].transpose(-1, -2)) * scale  # [B, H, w, w]
    causal = torch.ones(cfg.window, cfg.window, dtype=torch.bool, device=query.device).tril()
    win = win.masked_fill(~causal, float("-inf"))
    attn = torch.softmax(torch.cat([scores, win], -1), dim=-1)[..., :prefix].sum(-2)  # [B, H, prefix]
    attn = attn.view(b, hkv, groups, prefix).mean(2)  # [B, Hkv, prefix]
    pooled = torch.nn.functional.max_pool1d(attn, cfg.pool, stride=1, padding=cfg.pool // 2)
    top = pooled.topk(cfg.budget, dim=-1).indices.sort(-1).values  # [B, Hkv, budget]
    window_slots = torch.arange(prefix, length, device=query.device).expand(b, hkv, cfg.window)
    return torch.cat([top, window_slots], -1)


def snapkv_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA, plus SnapKV's selection on a first prefill (recorded on the model config's state)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cfg: SnapKVConfig | None = getattr(module.config, "byblock_snapkv", None)
    state: SnapKVState | None = getattr(module.config, "byblock_snapkv_state", None)
    if cfg is not None and state is not None and query.shape[2] == key.shape[2] > 1:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        sel = select_positions(query, key, cfg, scale)
        if sel is not None:
            state.selections[module.layer_idx] = sel
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def enable_snapkv(hf_model: torch.nn.Module, cfg: SnapKVConfig) -> SnapKVState:
    """Switch a transformers model to SDPA + SnapKV selection; returns the state the adapter reads."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    tc = hf_model.config.get_text_config()
    if any("sliding" in t for t in (getattr(tc, "layer_types", None) or [])):
        raise ValueError("SnapKV is not supported on models with sliding-window layers")
    AttentionInterface.register(NAME, snapkv_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    state = SnapKVState()
    for conf in {id(c): c for c in (hf_model.config, tc)}.values():
        conf.byblock_snapkv = cfg
        conf.byblock_snapkv_state = state
    hf_model.set_attn_implementation(NAME)
    return state


def apply_selection(cache, state: SnapKVState) -> None:
    """Gather each layer's kept slots per KV head (called once, after the prefill forward)."""
    if not state.selections:
        return
    for i, layer in enumerate(cache.hf.layers):
        sel = state.selections.get(i)
        if sel is None or not layer.is_initialized:
            continue
        idx = sel[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, idx)
        layer.values = layer.values.gather(2, idx)
    kept = next(iter(state.selections.values())).shape[-1]
    cache.pos = cache.pos[-kept:]  # slot positions are per head now; only the last (the window) is exact
    cache.key_summaries.clear()  # every slot moved
    state.selections.clear()


def enable_snapkv_on(target, cfg: SnapKVConfig) -> None:
    """SnapKV on a TargetModel: the SDPA path above, or on sliding-window models the per-head path of
    kv/h2o.py (heads keep different positions, so the window must be applied per head)."""
    if target.sliding_window is None:
        target.snapkv = enable_snapkv(target.hf, cfg)
        return
    from byblock.kv.h2o import enable_h2o

    target.h2o = enable_h2o(target.hf, None, snap=cfg)
