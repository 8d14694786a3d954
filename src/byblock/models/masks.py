"""The additive attention masks of multi-token forwards: new tokens that see the cached slots plus their tree
ancestors, per layer type for models with sliding-window layers (models/adapter.py builds them per forward)."""

from __future__ import annotations

import torch

from byblock.kv.kv_cache import StreamingWindow


def tree_attention_mask(
    past: int,
    positions: torch.Tensor,
    tree_mask: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    sliding_window: int | None = None,
    cache_pos: torch.Tensor | None = None,
    window: StreamingWindow | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive attention mask(s) for new tokens that see all `past` slots plus their tree ancestors.

    positions: [T] absolute positions of the new tokens; tree_mask: [T, T] bool, True where query i may
    see new token j (itself and its ancestors); sliding_window: the model's sliding layers' window (None: none);
    cache_pos: [past] absolute positions of the cached slots (default 0..past-1); window: StreamingLLM, each
    query sees only the sinks and its window.
    Returns [1, 1, T, past+T] in `dtype`, or a dict per layer type for models with sliding-window layers (the
    window is part of the mask, see kv/kv_cache.py).
    """
    t = positions.numel()
    allowed = torch.ones(t, past + t, dtype=torch.bool, device=device)
    allowed[:, past:] = tree_mask
    neg = torch.finfo(dtype).min
    kv_pos = torch.cat([torch.arange(past, device=device) if cache_pos is None else cache_pos, positions])
    if window is not None:
        in_window = (positions[:, None] - kv_pos[None, :]) < window.window
        allowed &= in_window | (kv_pos[None, :] < window.sinks)

    def additive(ok: torch.Tensor) -> torch.Tensor:
        return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill(~ok, neg)[None, None]

    if sliding_window is None:
        return additive(allowed)
    in_window = (positions[:, None] - kv_pos[None, :]) < sliding_window
    return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & in_window)}
