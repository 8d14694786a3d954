"""The DFlash drafter's inference forward: one or many requests' blocks, fused linears, one-call row ops.

`DFlashDraftModel.forward` (dflash_model.py) is the training and reference forward: module calls, torch's
norms and rotations, the context's and the block's K/V projected apart. Drafting runs this forward instead,
for one request (DFlashDrafter.draft_logits) or several (draft_blocks) alike, so a request's proposals are the
same bits batched or alone:

    per layer   x = RMSNorm(h)                                          one row-op call (kernels/row_ops.py)
                k | v = [context features ; x] W_kv                     one linear over both row sets (fused k / v)
                k = rotate(RMSNorm_head(k)), q = rotate(RMSNorm_head(x W_q))   one row-op call each
                attention per request over [its cache ; its context ; its block]
                h += o(attn);  h += down(silu(gate) * up)(RMSNorm(h))   gate / up fused

Why: a drafter forward of one request is ~2.3 ms warm on the 2-core CPU, most of it dispatch, not arithmetic
(17 norms at ~25 µs each as torch composes them, 9 rotations, 27 linear calls; dev/LOG.md, session 36). The
fused linears are bitwise the separate ones (kernels/fuse.py); the row ops are the torch composition's values to
fp32 rounding, which is free here: a drafter's proposals never change what is emitted, only how fast.
Elsewhere (bf16 drafters, a GPU, library linears) the same flow runs on the modules and torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from byblock.drafters.dflash_model import DFlashDraftModel, RMSNorm, rope_cos_sin, windowed
from byblock.kernels.fuse import bound, fuse_linears
from byblock.kernels.row_ops import norm_rope, torch_norm_rope

Linear = Callable[[torch.Tensor], torch.Tensor]


class DraftCache:
    """A request's drafter context K/V: per layer K and V in one buffer each, [layers, kv, capacity, d], slots
    [start, length) visible (start > 0 only for sliding-window drafters: older slots are never seen again).
    A forward writes its new context slots at `length` and its block's K/V right behind them (scratch, not
    committed), so each layer's attention reads one view of the buffer: no per-round concatenation."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.start = self.length = 0

    def reserve(self, extra: int) -> None:
        """Room for `extra` slots after `length` (the visible slots move to the front when the buffer grows)."""
        if self.k is not None and self.length + extra <= self.k.shape[2]:
            return
        layers, kv, d = self.shape
        live = self.length - self.start
        cap = max(64, 2 * (live + extra))
        k = torch.empty(layers, kv, cap, d, dtype=self.dtype, device=self.device)
        v = torch.empty_like(k)
        if self.k is not None and live:
            k[:, :, :live] = self.k[:, :, self.start : self.length]
            v[:, :, :live] = self.v[:, :, self.start : self.length]
        self.k, self.v, self.start, self.length = k, v, 0, live

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's visible context K and V, [kv, n, d] views."""
        assert self.k is not None and self.v is not None
        return self.k[i, :, self.start : self.length], self.v[i, :, self.start : self.length]


@dataclass
class PackedBlock:
    """One request's block in a drafter forward (DraftRunner)."""

    block_embeds: torch.Tensor  # [B, H]
    target_hidden: torch.Tensor  # [C, k*H] new context features
    block_positions: torch.Tensor  # [B]
    ctx_positions: torch.Tensor  # [C]
    cache: DraftCache  # this request's context K/V, extended by the forward


@dataclass(frozen=True)
class _Layer:
    attn: nn.Module
    in_norm: RMSNorm
    post_norm: RMSNorm
    q: Linear
    kv: Linear | None  # fused k / v, or None: k and v apart
    k: Linear
    v: Linear
    o: Linear
    gate_up: Linear | None  # fused gate / up, or None
    gate: Linear
    up: Linear
    down: Linear


class DraftRunner:
    """A DFlashDraftModel prepared for drafting (see the module docstring); shared by a drafter's forks."""

    def __init__(self, model: DFlashDraftModel) -> None:
        cfg = model.config
        self.model = model
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.inter = cfg.intermediate_size
        self.theta = cfg.rope_theta
        self.fc = bound(model.fc)
        self.layers = []
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    attn=a,
                    in_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    q=bound(a.q_proj),
                    kv=bound(fuse_linears([a.k_proj, a.v_proj])),
                    k=bound(a.k_proj),
                    v=bound(a.v_proj),
                    o=bound(a.o_proj),
                    gate_up=bound(fuse_linears([mlp.gate_proj, mlp.up_proj])),
                    gate=bound(mlp.gate_proj),
                    up=bound(mlp.up_proj),
                    down=bound(mlp.down_proj),
                )
            )

    def _norm(self, norm: RMSNorm, x: torch.Tensor, heads: int = 1, rope=None) -> torch.Tensor:
        """RMSNorm of x [M, heads * K] per head, then the rotation (cos, sin [M, K]) if given: [M, heads, K]. fp32
        on the row-op kernel (or torch's ops); other dtypes through the module, as its training forward does."""
        cos, sin = rope if rope is not None else (None, None)
        if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
            return norm_rope(x, heads, norm.weight, norm.eps, cos, sin)
        y = norm(x.reshape(x.shape[0], heads, -1))
        return y if cos is None else torch_norm_rope(y.flatten(1), heads, None, 0.0, cos, sin)

    def new_cache(self) -> DraftCache:
        """An empty context cache for one request."""
        cfg, dtype = self.model.config, self.model.dtype
        return DraftCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, self.model.hidden_norm.weight.device)

    def __call__(self, blocks: list[PackedBlock]) -> torch.Tensor:
        """Final-normed draft states [ΣB, H], request i's rows in order. Each request's new context K/V is
        appended to its cache."""
        model, d = self.model, self.head_dim
        dtype = model.dtype
        feats = torch.cat([b.target_hidden for b in blocks]).to(dtype)  # [ΣC, k*H]
        ctx = self._norm(model.hidden_norm, self.fc(feats)).flatten(1)  # [ΣC, H]
        block_rope = rope_cos_sin(torch.cat([b.block_positions for b in blocks]), d, self.theta, dtype)  # [ΣB, d]
        ctx_rope = rope_cos_sin(torch.cat([b.ctx_positions for b in blocks]), d, self.theta, dtype)
        kv_rope = (torch.cat([ctx_rope[0], block_rope[0]]), torch.cat([ctx_rope[1], block_rope[1]]))
        h = torch.cat([b.block_embeds for b in blocks]).to(dtype)  # [ΣB, H]
        n_ctx = ctx.shape[0]
        block_cuts = _cuts([b.block_embeds.shape[0] for b in blocks])
        ctx_cuts = _cuts([b.target_hidden.shape[0] for b in blocks])
        gqa = self.heads != self.kv_heads
        for b in blocks:
            b.cache.reserve(b.target_hidden.shape[0] + b.block_embeds.shape[0])
        for i, L in enumerate(self.layers):
            x = self._norm(L.in_norm, h).flatten(1)  # [ΣB, H]
            rows = torch.cat([ctx, x])  # the context's and the block's K/V come from the same weights
            if L.kv is not None:
                kv = L.kv(rows)
                k_in, v = kv[:, : self.kv_size], kv[:, self.kv_size :]
            else:
                k_in, v = L.k(rows), L.v(rows)
            k = self._norm(L.attn.k_norm, k_in, self.kv_heads, kv_rope)  # [ΣC + ΣB, kv, d]
            v = v.reshape(v.shape[0], self.kv_heads, d)
            q = self._norm(L.attn.q_norm, L.q(x), self.heads, block_rope)  # [ΣB, heads, d]
            outs = []
            for b, (s0, s1), (c0, c1) in zip(blocks, block_cuts, ctx_cuts, strict=True):
                cache = b.cache
                at, t = cache.length + c1 - c0, s1 - s0  # this round's context ends at slot `at`
                for buf, new in ((cache.k, k), (cache.v, v)):
                    buf[i, :, cache.length : at] = new[c0:c1].transpose(0, 1)
                    buf[i, :, at : at + t] = new[n_ctx + s0 : n_ctx + s1].transpose(0, 1)
                first, mask = cache.start, None
                if L.attn.window is not None:  # only the last window - 1 context slots can be seen
                    kept, _, mask = windowed(
                        cache.k[i, :, first:at][None], cache.v[i, :, first:at][None], t, L.attn.window
                    )
                    first = at - kept.shape[2]
                keys, values = cache.k[i, :, first : at + t][None], cache.v[i, :, first : at + t][None]
                qb = q[s0:s1].transpose(0, 1)[None]  # [1, heads, B, d]
                out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, enable_gqa=gqa)
                outs.append(out[0].transpose(0, 1).reshape(t, -1))
            h = h + L.o(torch.cat(outs))
            x = self._norm(L.post_norm, h).flatten(1)
            if L.gate_up is not None:
                gate, up = L.gate_up(x).split((self.inter, self.inter), dim=-1)
            else:
                gate, up = L.gate(x), L.up(x)
            h = h + L.down(F.silu(gate) * up)
        for b in blocks:  # the new context slots are committed; the block's stay scratch
            b.cache.length += b.target_hidden.shape[0]
            window = model.config.sliding_window
            if window is not None:
                b.cache.start = max(b.cache.start, b.cache.length - (window - 1))
        return self._norm(model.norm, h).flatten(1)


def _cuts(sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out
