"""The DFlash draft network (seed 002; reference: PyPI `dflash` 0.1.0 `DFlashDraftModel`), written for byblock.

A few Qwen3-style layers draft a whole block in one forward. Notation of the paper:

    H_t = RMSNorm(W_c [H^(l1); ...; H^(lk)])         fused target features of the context (fc, hidden_norm)
    block input  = E([x_a, MASK, ..., MASK])          the target's frozen embedding, B rows
    every layer: Q from the block only; K = [W_K H_t ; W_K h],  V = [W_V H_t ; W_V h]   ("KV injection")
    attention:   bidirectional inside the block, plus every context position before the anchor
    draft logits = target_lm_head(norm(h))[1:]        row j predicts the token at position a + j

Weight names, shapes and the config keys match the reference checkpoint layout (see export in
drafters/dflash_format.py), so a byblock-trained drafter loads in the reference, vLLM and SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a DFlash drafter and how it plugs into its target."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int  # the target's (the drafter shares its embedding and LM head)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 8192
    # Sliding-window attention over the context (MiMo's drafter, DFlash 2's sliding layers): a block row at
    # position p sees context positions q with p - q < W (transformers' and vLLM's rule); None: all of it.
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict, compare=False)  # provenance (target name, recipe) for config.json

    @property
    def num_features(self) -> int:
        """How many target layers' hidden states are fused (k)."""
        return len(self.target_layer_ids)


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 like the reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not torch.is_grad_enabled():
            # Drafting: torch's fused op, bitwise the composition below in fp32 (tests/test_dflash.py), one
            # dispatch instead of six (a drafter forward runs 17 of these). Training keeps the composition.
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [..., T, head_dim] for integer positions [..., T] (half-rotation RoPE)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (steps / head_dim))  # [d/2]
    freqs = positions.float()[..., None] * inv_freq  # [..., T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, h, T, d] rotated by cos/sin [b, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DraftAttention(nn.Module):
    """Block queries over [context keys ; block keys]; same K/V weights for both (KV injection)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.window = cfg.sliding_window

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v  # [b, kv, t, d] each

    def forward(
        self,
        x: torch.Tensor,  # [b, T, H] normed block states
        ctx: torch.Tensor,  # [b, C, H] fused context features (new ones only when a cache is given)
        block_rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [b, T, d]
        ctx_rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [b, C, d]
        mask: torch.Tensor | None,  # [b, 1, T, C_all + T] bool (True = may attend); None = see everything
        cache: list[torch.Tensor] | None,  # [K, V] of earlier context for this layer; extended in place
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *block_rope)  # [b, h, T, d]
        kc, vc = self._kv(ctx, *ctx_rope)  # [b, kv, C, d]
        if cache is not None:
            if cache:
                kc, vc = torch.cat([cache[0], kc], dim=2), torch.cat([cache[1], vc], dim=2)
            cache[:] = [kc, vc]
        if self.window is not None and mask is None:  # drafting: the context is every position before the block
            kc, vc, mask = windowed(kc, vc, t, self.window)
            if cache is not None:
                cache[:] = [kc, vc]  # older slots are never seen again
        kb, vb = self._kv(x, *block_rope)  # [b, kv, T, d]
        k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)  # [b, kv, C_all + T, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def windowed(
    kc: torch.Tensor, vc: torch.Tensor, t: int, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Context K/V [b, kv, n, d] ending just before a block of t rows -> the last window-1 slots (all any row can
    see: the anchor row at position a sees positions > a - window) and the mask [1, 1, t, n' + t] of row j, which
    sees context slot c iff c > n' + j - window; None when every row sees every kept slot."""
    keep = window - 1
    if kc.shape[2] > keep:
        kc, vc = kc[:, :, kc.shape[2] - keep :], vc[:, :, vc.shape[2] - keep :]
    n = kc.shape[2]
    if n + t - 1 < window:
        return kc, vc, None
    rows = torch.arange(t, device=kc.device)[:, None]
    ctx_ok = torch.arange(n, device=kc.device)[None, :] > n + rows - window  # [t, n]
    block_ok = torch.ones(t, t, dtype=torch.bool, device=kc.device)
    return kc, vc, torch.cat([ctx_ok, block_ok], dim=1)[None, None]


class DraftMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; the context features skip the layer norms, Q, O and the MLP."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = DraftMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, ctx, block_rope, ctx_rope, mask, cache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, block_rope, ctx_rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The trainable part of a DFlash drafter: layers + fc + hidden_norm + norm (no embedding, no head)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype. Read from a norm: `fc.weight` of a packed fp32 drafter unpacks a fresh copy."""
        return self.hidden_norm.weight.dtype

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """H_t = RMSNorm(W_c [H^(l1); ...; H^(lk)]): [b, C, k*H] -> [b, C, H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [b, T, H] target embeddings of [anchor, MASK...] (T = blocks * B)
        target_hidden: torch.Tensor,  # [b, C, k*H] raw concatenated target features (new context only)
        block_positions: torch.Tensor,  # [b, T]
        ctx_positions: torch.Tensor,  # [b, C]
        mask: torch.Tensor | None = None,  # [b, 1, T, C_all + T] bool; None = bidirectional over everything
        cache: list[list[torch.Tensor]] | None = None,  # per layer [K, V] of earlier context, extended in place
    ) -> torch.Tensor:
        """Final-normed draft states [b, T, H]; the target's LM head turns them into draft logits."""
        dtype = self.dtype
        d, theta = self.config.head_dim, self.config.rope_theta
        ctx = self.fuse(target_hidden)
        block_rope = rope_cos_sin(block_positions, d, theta, dtype)
        ctx_rope = rope_cos_sin(ctx_positions, d, theta, dtype)
        h = block_embeds.to(dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, block_rope, ctx_rope, mask, None if cache is None else cache[i])
        return self.norm(h)


def init_from_target(draft: DFlashDraftModel, target_hf: nn.Module) -> list[int]:
    """Copy the target's last decoder layers into the draft layers where the shapes agree.

    A warm start (the draft layers then begin as the target's own top of stack); q_norm / k_norm stay at 1,
    as the target's layers have none. Returns the target layer indices used.
    """
    base = getattr(target_hf, "model", target_hf)
    layers = list(base.layers)
    chosen = list(range(len(layers) - len(draft.layers), len(layers)))
    for dst, src_idx in zip(draft.layers, chosen, strict=True):
        src = layers[src_idx]
        pairs = {
            dst.self_attn.q_proj: src.self_attn.q_proj,
            dst.self_attn.k_proj: src.self_attn.k_proj,
            dst.self_attn.v_proj: src.self_attn.v_proj,
            dst.self_attn.o_proj: src.self_attn.o_proj,
            dst.mlp.gate_proj: src.mlp.gate_proj,
            dst.mlp.up_proj: src.mlp.up_proj,
            dst.mlp.down_proj: src.mlp.down_proj,
            dst.input_layernorm: src.input_layernorm,
            dst.post_attention_layernorm: src.post_attention_layernorm,
        }
        with torch.no_grad():
            for d_mod, s_mod in pairs.items():
                if d_mod.weight.shape == s_mod.weight.shape:
                    d_mod.weight.copy_(s_mod.weight)
    with torch.no_grad():
        draft.norm.weight.copy_(base.norm.weight)
    return chosen
