"""The EAGLE-3 draft network (arXiv:2503.01840; layouts: SpecForge `LlamaForCausalLMEagle3`, vLLM
`llama_eagle3.py`), written for byblock.

One decoder layer drafts autoregressively, one token per step, reading the target's fused features:

    g_i   = fc([h_low ; h_mid ; h_high]_i)          three target layers' states at position i, fused (3H -> H)
    step  input at position p: [input_layernorm(E(x_{p+1})) ; hidden_norm(g)]  (2H into q / k / v)
          where g is g_p for a committed position, or the draft's own previous output for a drafted one
    out   = g + attn(...) ; out = out + mlp(post_attention_layernorm(out))     (the pre-norm sum is fed back)
    logits = lm_head(norm(out)) over a reduced draft vocabulary; target id = i + d2t[i]

Position p's output predicts x_{p+2}: the token after the one whose embedding it read. Weight names (`fc`,
`midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`) and the config keys are the ones SpecForge writes and vLLM
loads, so a byblock-trained head exports as is (drafters/eagle3_format.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from byblock.drafters.dflash_model import RMSNorm, apply_rope, rope_cos_sin
from byblock.errors import InvalidParameterError


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head and how it plugs into its target."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]  # byblock's indexing: layer i's output (vLLM's aux ids are i + 1)
    num_target_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 8192
    extra: dict = field(default_factory=dict, compare=False)  # provenance (target name, recipe) for config.json

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidParameterError("EAGLE-3: heads must group over the key/value heads")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise InvalidParameterError("EAGLE-3: the draft vocabulary must be 1 .. the target's vocabulary")
        if not self.target_layer_ids or max(self.target_layer_ids) >= self.num_target_layers:
            raise InvalidParameterError(f"EAGLE-3: feature layers {list(self.target_layer_ids)} outside the target")


def default_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default low / mid / high layers (aux ids 2, L//2, L−3) in byblock's indexing (one less)."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)


class _Attention(nn.Module):
    """q / k / v from the 2H step input, GQA over the committed and drafted keys, o back to H."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class StepKV:
    """The keys and values one step's rows wrote: [b, kv, n, d] each."""

    k: torch.Tensor
    v: torch.Tensor


class Eagle3DraftModel(nn.Module):
    """fc + one decoder layer + norm + lm_head over the draft vocabulary (see the module docstring)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # target = i + d2t[i]
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))  # target ids in the draft vocab

    def draft_vocab(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary, in draft order."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, vocab: torch.Tensor) -> None:
        """Install the draft vocabulary: `vocab` [Vd] target ids, ascending (d2t offsets and the t2d mask)."""
        vocab = vocab.to(self.d2t.device)
        if vocab.numel() != self.config.draft_vocab_size:
            raise InvalidParameterError(
                f"draft vocabulary of {vocab.numel()}, config says {self.config.draft_vocab_size}"
            )
        self.d2t.copy_(vocab - torch.arange(vocab.numel(), device=vocab.device))
        self.t2d.zero_()
        self.t2d[vocab] = True

    def step(
        self,
        embeds: torch.Tensor,  # [b, T, H] target embeddings of the tokens these rows read
        hidden: torch.Tensor,  # [b, T, H] fused features (fc output) or the draft's own previous outputs
        positions: torch.Tensor,  # [b, T]
        past: list[StepKV],  # keys / values the rows may attend besides their own (in mask column order)
        mask: torch.Tensor | None,  # [b, 1, T, Σpast + T] bool; None: causal over past + these rows
    ) -> tuple[torch.Tensor, StepKV]:
        """One layer pass -> (the pre-norm outputs [b, T, H] that are fed back, this step's keys and values)."""
        a = self.midlayer.self_attn
        b, t, _ = embeds.shape
        x = torch.cat([self.midlayer.input_layernorm(embeds), self.midlayer.hidden_norm(hidden)], dim=-1)
        cos, sin = rope_cos_sin(positions, a.head_dim, self.config.rope_theta, x.dtype)
        q = apply_rope(a.q_proj(x).view(b, t, a.num_heads, a.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(a.k_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        keys = torch.cat([*(p.k for p in past), k], dim=2)
        values = torch.cat([*(p.v for p in past), v], dim=2)
        causal = mask is None and t > 1
        if causal and keys.shape[2] > t:  # a causal block after a past: spell the mask out
            mask = torch.ones(t, keys.shape[2], dtype=torch.bool, device=x.device).tril(keys.shape[2] - t)[None, None]
            causal = False
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, enable_gqa=a.num_heads != a.num_kv_heads
        )
        h = hidden + a.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        h = h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
        return h, StepKV(k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of step outputs [..., H] -> [..., Vd]."""
        return self.lm_head(self.norm(out))


def init_from_target(model: Eagle3DraftModel, target_hf: nn.Module, vocab: torch.Tensor) -> None:
    """Warm start from the target: its last layer's attention and MLP (q / k / v read the feature half of the
    2H input), its norms, its LM head's rows of the draft vocabulary. Shapes that disagree stay random."""
    base = getattr(target_hf, "model", target_hf)
    src = base.layers[-1]
    dst = model.midlayer
    h = model.config.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w, s = getattr(dst.self_attn, name).weight, getattr(src.self_attn, name).weight
            if s.shape == w[:, h:].shape:
                w[:, h:].copy_(s)
                w[:, :h].mul_(0.1)  # the embedding half starts small: the features carry the signal at first
        pairs = [
            (dst.self_attn.o_proj, src.self_attn.o_proj),
            (dst.mlp.gate_proj, src.mlp.gate_proj),
            (dst.mlp.up_proj, src.mlp.up_proj),
            (dst.mlp.down_proj, src.mlp.down_proj),
            (dst.input_layernorm, src.input_layernorm),
            (dst.hidden_norm, src.input_layernorm),
            (dst.post_attention_layernorm, src.post_attention_layernorm),
            (model.norm, base.norm),
        ]
        for d_mod, s_mod in pairs:
            if d_mod.weight.shape == s_mod.weight.shape:
                d_mod.weight.copy_(s_mod.weight)
        head = target_hf.get_output_embeddings().weight
        if head.shape[1] == h:
            model.lm_head.weight.copy_(head[vocab.to(head.device)].float())
