"""byblock's own decoder forward for the llama family (llama, qwen3), over the transformers model's own weights.

Why: on a CPU with quantized linears a decode step of SmolLM2-135M is short enough that transformers' per-layer
Python — module calls, kwargs plumbing, output recording, mask building — costs as much as the matrix work
(dev/LOG.md, session 24). This forward does the same arithmetic as transformers' modules (RMSNorm, rotary
embedding, SiLU-gated MLP) on the same weights and the same attention kernel (kernels/gqa_sdpa.py, per request
for packed batches: kernels/ragged.py), with the Python of one loop. TargetModel uses it only where it applies
(fp32, byblock's attention, one sequence or a packed batch, no KV policy that hooks attention).

Two ways to run the norms and rotations (DecoderOps): `exact` composes torch's ops as transformers does, so the
outputs are bitwise transformers' (tests/test_decoder.py: the HF module path stays the reference); the default
on the CPU runs them as one kernel call each (kernels/row_ops.py): torch's rms_norm is a composite of six
dispatches there, ~20 us a call, and a decode step of the default model makes 61 norms and 30 rotations (2.5 ms
of a ~13 ms step, dev/LOG.md session 39). Those values are transformers' to fp32 rounding, not bitwise; each row
is computed on its own in one fixed order, so the forward stays row-invariant and speculative decoding stays
token-identical to plain decoding on it (the losslessness suite runs on this path).

Fusion: the q / k / v projections run as one linear, and gate / up as one, when the linears are byblock's
row-invariant kernels (kernels/fuse.py: bitwise what the separate calls give, the weights shared, not copied).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from byblock.kernels.fuse import bound, fuse_linears
from byblock.kernels.gqa_sdpa import NAME as GQA_SDPA
from byblock.kernels.row_ops import RowOps, load_row_ops

ARCHITECTURES = frozenset({"llama", "qwen3"})

# attend(attention module, q [B, H, T, D], k / v [B, Hkv, T, D] of the new rows) -> [B, T, H, D]
Attend = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in fp32 (weight * (x * rsqrt(mean(x^2) + eps))) as torch's one fused op: bitwise
    the same values on the CPU (tests/test_decoder.py checks), one dispatch instead of six."""
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding on [B, H, T, D] (`x * cos + rotate_half(x) * sin`), op for op."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


@dataclass(frozen=True)
class DecoderOps:
    """How the decoder runs its norms and rotations. exact: torch's ops, bitwise transformers' modules; else the
    row kernel where it builds and the model is on the CPU (fp32 rounding of those values, row-invariant)."""

    exact: bool = False


@dataclass(frozen=True)
class _Layer:
    attn: nn.Module  # transformers' attention module: layer_idx, scaling, config for the attention kernel
    mlp: nn.Module
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None  # qwen3's per-head norms
    k_norm: torch.Tensor | None
    qkv: Callable[[torch.Tensor], torch.Tensor] | None  # fused q / k / v (bound), or None: the three projections
    gate_up: Callable[[torch.Tensor], torch.Tensor] | None
    q_size: int
    kv_size: int
    inter: int
    o_proj: Callable[[torch.Tensor], torch.Tensor]  # the layer's linears as the loop calls them (bound)
    down_proj: Callable[[torch.Tensor], torch.Tensor]


class DecoderForward:
    """The decoder stack of a llama-family transformers model as one Python loop over its own modules."""

    def __init__(self, hf_model: nn.Module, ops: DecoderOps | None = None) -> None:
        cfg = hf_model.config
        ops = ops or DecoderOps()
        on_cpu = next(hf_model.parameters()).device.type == "cpu"
        self.row_ops: RowOps | None = None if ops.exact or not on_cpu else load_row_ops()
        base = hf_model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm_weight = base.norm.weight
        self.eps = float(cfg.rms_norm_eps)
        self.layers = []
        for layer in base.layers:
            a, mlp = layer.self_attn, layer.mlp
            qn = getattr(a, "q_norm", None)
            kn = getattr(a, "k_norm", None)
            self.layers.append(
                _Layer(
                    attn=a,
                    mlp=mlp,
                    in_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    q_norm=None if qn is None else qn.weight,
                    k_norm=None if kn is None else kn.weight,
                    qkv=bound(fuse_linears([a.q_proj, a.k_proj, a.v_proj])),
                    gate_up=bound(fuse_linears([mlp.gate_proj, mlp.up_proj])),
                    q_size=a.q_proj.out_features,
                    kv_size=a.k_proj.out_features,
                    inter=mlp.gate_proj.out_features,
                    o_proj=bound(a.o_proj),
                    down_proj=bound(mlp.down_proj),
                )
            )
        self.head_dim = self.layers[0].attn.head_dim
        if self.head_dim % 8:  # the row kernel's lanes
            self.row_ops = None

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim (the row kernel, or torch's op)."""
        if self.row_ops is None:
            return _rms(x, weight, self.eps)
        width = x.shape[-1]
        return self.row_ops(x.reshape(-1, width), 1, weight, self.eps, None, None).view(x.shape)

    def _rope_rows(
        self, x: torch.Tensor, heads: int, norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The row kernel on x [B, T, >= heads * D] (its first heads): each head normed (norm not None) and
        rotated -> [B, heads, T, D]."""
        b, t = x.shape[:2]
        assert self.row_ops is not None
        rows = x.reshape(b * t, -1)[:, : heads * self.head_dim]  # a column slice: the kernel reads it in place
        out = self.row_ops(rows, heads, norm, self.eps, cos, sin)  # [B*T, heads, D]
        return out.view(b, t, heads, -1).transpose(1, 2)

    @staticmethod
    def supports(hf_model: nn.Module) -> bool:
        """Whether this forward reproduces `hf_model` exactly: a llama / qwen3 causal LM in fp32 on byblock's
        attention kernel, SiLU MLP, no sliding-window layers."""
        cfg = getattr(hf_model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
            return False
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "_attn_implementation", None) != GQA_SDPA:
            return False
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
            return False
        first = next(hf_model.parameters())
        return first.dtype == torch.float32 and hasattr(hf_model, "model") and hasattr(hf_model.model, "rotary_emb")

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, hidden_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids / positions [B, T] -> (the final normed states [B, T, H], {layer: its output} for
        `hidden_layers`, with transformers' indexing: the last layer's entry is the normed output)."""
        h = self.embed(input_ids)
        b, t = input_ids.shape
        cos, sin = self.rotary(h, positions)
        fast = self.row_ops is not None
        if fast:  # [B*T, D]: one position per row
            cos, sin = cos.reshape(b * t, -1).contiguous(), sin.reshape(b * t, -1).contiguous()
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]: broadcast over heads, once per forward
        hd, eps = self.head_dim, self.eps
        hidden: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        norm = self._norm
        for i, L in enumerate(self.layers):
            x = norm(h, L.in_norm)
            a = L.attn
            if fast:
                qkv = L.qkv(x) if L.qkv is not None else torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1)
                nq, nk = L.q_size // hd, L.kv_size // hd
                if L.q_norm is None:  # q and k heads side by side: one call
                    qk = self._rope_rows(qkv, nq + nk, None, cos, sin)
                    q, k = qk[:, :nq], qk[:, nq:]
                else:
                    q = self._rope_rows(qkv, nq, L.q_norm, cos, sin)
                    k = self._rope_rows(qkv[..., L.q_size :], nk, L.k_norm, cos, sin)
                v = qkv[..., L.q_size + L.kv_size :].view(b, t, nk, hd).transpose(1, 2)
            elif L.qkv is not None and L.q_norm is None:
                # One rotary pass over q and k side by side: the rotation is elementwise per head, so each head
                # gets bitwise what two separate calls give, for half the dispatches.
                qkv = L.qkv(x).view(b, t, -1, hd)
                nq = L.q_size // hd
                qk = rotate(qkv[:, :, : nq + L.kv_size // hd].transpose(1, 2), cos, sin)
                q, k, v = qk[:, :nq], qk[:, nq:], qkv[:, :, nq + L.kv_size // hd :].transpose(1, 2)
            else:
                if L.qkv is not None:
                    q, k, v = L.qkv(x).split((L.q_size, L.kv_size, L.kv_size), dim=-1)
                else:
                    q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
                q, k, v = q.view(b, t, -1, hd), k.view(b, t, -1, hd), v.view(b, t, -1, hd)
                if L.q_norm is not None:
                    q, k = _rms(q, L.q_norm, eps), _rms(k, L.k_norm, eps)
                q, k = rotate(q.transpose(1, 2), cos, sin), rotate(k.transpose(1, 2), cos, sin)
                v = v.transpose(1, 2)
            out = attend(a, q, k, v)
            h = h + L.o_proj(out.reshape(b, t, -1))
            x = norm(h, L.post_norm)
            if L.gate_up is not None:
                gate, up = L.gate_up(x).split((L.inter, L.inter), dim=-1)
            else:
                gate, up = L.mlp.gate_proj(x), L.mlp.up_proj(x)
            h = h + L.down_proj(F.silu(gate) * up)
            if i in hidden_layers and i != last:
                hidden[i] = h
        final = norm(h, self.norm_weight)
        if last in hidden_layers:
            hidden[last] = final
        return final, hidden
