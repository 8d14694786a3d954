"""SDPA attention that never materialises grouped K/V: `enable_gqa=True` whatever the mask.

transformers' `sdpa` backend passes `enable_gqa` to torch only when there is no attention mask (a CUDA kernel
constraint; one masked query instead folds its group into the query length, kept here). On CPU every verify
forward carries a mask (a cached past plus a causal or tree block), so it falls
back to `repeat_kv`: each layer copies its whole cached K and V `num_key_value_groups` times per forward. Torch's
CPU kernel handles GQA with a mask directly, with bitwise the same output (the grouped head reads the same keys
in the same order): on one core at 300 cached tokens a 17-token verify's attention takes 0.44 ms per layer
instead of 0.51, and at 1,000 tokens 1.0 ms instead of 1.7 (dev/LOG.md, session 14).

Causal rows run in query tiles aligned to absolute positions (multiples of PREFILL_TILE): the tile of rows
[a, b) always attends keys [0, b) in one kernel call with the same mask, whether the rows came in one prompt
forward or in several chunks. Torch's CPU kernel blocks a call's queries by the call's length, so one
600-token call and two 300-token calls round differently (~1e-6 in the logits); aligned tiles make chunked
prefill (engine/scheduler.py) bitwise the unchunked one, so a chunked request still gets its solo tokens.

Rows with a cached past that are not a prompt's (decode steps, chain and tree verifies) run the row-local kernel
instead where it builds (CPU, fp32; kernels/row_attention.py): each row over exactly its visible keys, so a
verified token gets bitwise the attention its plain decode step gets. Prompt chunks say so (PROMPT_KWARG) and
keep the tiles, which is what keeps a chunked prompt bitwise its unchunked prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from byblock.kernels.ragged import BATCH_KWARG, PROMPT_KWARG
from byblock.kernels.row_attention import key_sets, load_row_attention

NAME = "byblock_sdpa"
PREFILL_TILE = 64  # query rows per kernel call for causal rows; prefill chunks are multiples of it


def gqa_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D], key/value [B, Hkv, S, D], attention_mask additive or bool [B|1, 1, T, S] or None
    -> ([B, T, H, D], None), the contract of transformers' attention functions."""
    if (batch := kwargs.pop(BATCH_KWARG, None)) is not None:  # a packed batch: per sequence (kernels/ragged.py)
        return batch.attend(
            gqa_sdpa_attention_forward, module, query, key, value, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise ValueError("byblock's SDPA attention does not support softcapping; load the model with eager attention")
    prompt = kwargs.pop(PROMPT_KWARG, False)
    t = query.shape[2]
    if not prompt and key.shape[2] > t and not dropout and query.dtype == torch.float32 and query.is_cpu:
        rows = key_sets(attention_mask, t, key.shape[2])
        if rows is not False and (kernel := load_row_attention()) is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return kernel(query, key, value, rows, scale), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(t > 1 and attention_mask is None and causal)
    if causal and key.shape[2] != t:  # an unmasked causal call is a prefill over exactly its own tokens
        raise ValueError("unmasked causal attention needs as many keys as queries")
    bool_mask = attention_mask is not None and attention_mask.dtype == torch.bool
    if causal or (t > 1 and bool_mask):  # causal rows (a prompt, a chunk, a chain); additive tree masks run whole
        return _causal_tiles(query, key, value, attention_mask, dropout, scaling), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and attention_mask is not None and t == 1:
        # transformers' own path for one masked query (padded batched decoding): fold the group's heads into
        # the query length. As fast as enable_gqa here, and the same bits as before this module existed.
        b, _, _, d = query.shape
        query = query.reshape(b, key.shape[1], groups, d)
        if attention_mask.shape[1] != 1:
            attention_mask = attention_mask.reshape(attention_mask.shape[0], key.shape[1], groups, -1)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],  # after a fold the heads match
    )
    out = out.reshape(out.shape[0], -1, t, value.shape[-1])  # undoes the fold; a no-op otherwise
    return out.transpose(1, 2).contiguous(), None


def _causal_tiles(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """The last T of S positions attending causally (mask None) or through a bool mask [B|1, 1, T, S], one
    kernel call per aligned tile of rows (see the module docstring) -> [B, T, H, D]."""
    t, s = query.shape[2], key.shape[2]
    first = s - t  # absolute index of the first query row
    outs, a = [], first
    while a < s:
        b = min(s, (a // PREFILL_TILE + 1) * PREFILL_TILE)
        if mask is None:
            tile = torch.ones(b - a, b, dtype=torch.bool, device=query.device).tril(diagonal=a)[None, None]
        else:
            tile = mask[..., a - first : b - first, :b]
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, a - first : b - first],
                key[:, :, :b],
                value[:, :, :b],
                attn_mask=tile,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        )
        a = b
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous()


def enable_gqa_sdpa(hf_model: torch.nn.Module) -> None:
    """Switch a transformers model loaded with `sdpa` attention to gqa_sdpa_attention_forward."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    hf_model.set_attn_implementation(NAME)
