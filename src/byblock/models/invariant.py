"""Row-invariant bf16 inference: a token's logits do not depend on how many tokens share its forward.

Why: speculative decoding is lossless only if the target's verify forward over k tokens computes, for each
token, exactly what k plain decode steps would have. In fp32 the kernels' different summation orders for 1
row and k rows almost never flip an argmax; in bf16 they do, on most prompts (dev/LOG.md, session 2). The
same problem ("batch invariance") breaks determinism of LLM servers; the cure is the same: every reduction
must be done in an order that does not depend on the number of rows in the call.

What this CPU's kernels do (probed in tests/test_invariant.py and dev/LOG.md, session 5):
- bf16 GEMM (`x @ W_t`, and batched `@`) gives bitwise the same row for any row count >= 2, but a single
  row takes a different (GEMV) path. So a 1-row input is padded to 2 rows (`RowInvariantLinear`).
- It also accumulates along the reduction axis in order, so appending or inserting keys whose softmax
  weight is exactly 0 leaves a row unchanged: a masked verify row (extra keys after it, or a tree's
  non-ancestors in between) equals the plain step over its visible keys.
- fp32 GEMMs and SDPA's kernels are *not* row-count invariant, and neither is a `sum` over a row with
  a different number of masked entries.

So decode and verify forwards (those with a cached past) use `invariant_attention_forward`: scores as one
bf16 GEMM, softmax numerator exp(s - max) in fp32 rounded to bf16 (the max is exact in any order), and
numerator and denominator as bf16 GEMMs of those weights with V and with a column of ones. Its precision
is that of transformers' eager bf16 attention. The prompt (no past) goes through SDPA: plain and
speculative decoding prefill identically, so the prompt needs no invariance and keeps the fast kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from byblock.models.fast_linear import InOutLinear

NAME = "byblock_invariant"


class RowInvariantLinear(nn.Module):
    """y = x W^T + b whose value for a row does not depend on how many rows x has (bf16 on this CPU).

    Weight kept [out, in]: for bf16, `F.linear` is as fast as or faster than the [in, out] layout at every
    row count measured here (dev/LOG.md, session 5), unlike fp32 (models/fast_linear.py)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        # One row would take the GEMV path; two rows take the GEMM every larger input takes. The copy must
        # be real: a stride-0 `expand` picks yet another kernel (and is 5-10x slower).
        return F.linear(torch.cat([x, x], dim=-2), self.weight, self.bias)[..., :1, :]


def invariant_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: SDPA for a prompt, row-invariant GEMM attention after it.

    query: [B, H, T, D]; key/value: [B, Hkv, L, D] (L = past + T); attention_mask: additive or bool,
    broadcastable to [B, 1, T, L], or None (then causal). Returns ([B, T, H, D], None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bsz, heads, t, dim = query.shape
    hkv, length = key.shape[1], key.shape[2]
    if length == t:  # no past: a prompt, identical in plain and speculative decoding
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    group = heads // hkv
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(bsz, hkv, group * t, dim)  # rows ordered (head in group, token)
    rows = group * t
    if rows == 1:  # GEMM, not GEMV (see module docstring)
        q = torch.cat([q, q], dim=2)
    s = (q @ key.transpose(-1, -2))[:, :, :rows].float() * scale  # [B, Hkv, rows, L]
    softcap = kwargs.get("softcap")
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.view(bsz, hkv, group, t, length)
    if attention_mask is None:
        if t > 1:
            causal = torch.ones(t, length, dtype=torch.bool).tril(length - t)
            s = s.masked_fill(~causal, float("-inf"))
    else:
        m = attention_mask[:, :, :, -length:]  # [B|1, 1, T, L]
        m = m[:, :, None]  # broadcast over the group
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    s = s.view(bsz, hkv, rows, length)
    w = torch.exp(s - s.amax(dim=-1, keepdim=True)).to(value.dtype)  # [B, Hkv, rows, L]
    if rows == 1:
        w = torch.cat([w, w], dim=2)
    ones = torch.ones(*value.shape[:-1], 1, dtype=value.dtype)
    num = (w @ value)[:, :, :rows].float()  # [B, Hkv, rows, D]
    den = (w @ ones)[:, :, :rows].float()  # [B, Hkv, rows, 1]
    out = (num / den).to(query.dtype).view(bsz, heads, t, dim)
    return out.transpose(1, 2).contiguous(), None


def enable_row_invariance(hf_model: nn.Module) -> int:
    """Make decode and verify forwards of `hf_model` row-invariant; returns how many linears were swapped.

    Linears may be nn.Linear or InOutLinear (load_model's default relayout); others are left alone.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, invariant_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    count = 0
    for parent in list(hf_model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (InOutLinear, nn.Linear):
                setattr(parent, name, RowInvariantLinear(child))
                count += 1
    hf_model.set_attn_implementation(NAME)
    return count
