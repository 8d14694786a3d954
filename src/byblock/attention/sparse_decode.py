"""Sparse attention for decode and verify rows over a long cache (`--sparse-decode K`), row-local by design.

Each new row (a decoded token, or one row of a speculative verify, chain or tree) attends to:
  * the sink blocks (the first `sink_blocks` blocks of its keys),
  * its recent keys densely: every visible key from block e = ⌊(p − W + 1) / b⌋ on, p its position, W the
    decode window (so at least the W most recent positions, itself included),
  * the K key blocks in [sinks, e) with the highest Quest bound Σ_d max(q_d·max_k k_d, q_d·min_k k_d) (the
    elementwise extremes of each block's keys: an upper bound of q·k over the block).

Why this is lossless under speculative decoding *with respect to the sparse model*: the selectable blocks end
before p − W + 1, and W is at least the number of rows in the forward, so they only hold committed keys: a row
at position p sees the same candidate blocks, the same scores and the same recent keys whether it is decoded
alone or verified beside 31 drafted rows. Each row is computed on its own (its gathered keys, one query), so its
arithmetic does not depend on its neighbours either. Keys are ranked by their order among the row's visible
keys (the attention mask), so a tree row's ancestors stand where plain decoding would have put those tokens.
Block extremes are exact (max/min), computed once per forward over the contiguous committed prefix.

The prefill of a prompt is not touched (Stem's prefill, or dense). Reference: Quest (Tang et al. 2024) for
the block bound; ../shared/reference/sparse_attention.md for the seed's framing.
"""

from __future__ import annotations

import torch


def visible_keys(attention_mask: torch.Tensor | None, batch: int, row: int, lq: int, lk: int) -> torch.Tensor:
    """Indices of the keys query `row` of sequence `batch` may see, ascending (None mask: causal, no padding)."""
    dev = attention_mask.device if attention_mask is not None else None
    if attention_mask is None:
        return torch.arange(lk - lq + row + 1, device=dev)
    m = attention_mask[batch, 0, row] if attention_mask.shape[0] > 1 else attention_mask[0, 0, row]
    if m.dtype != torch.bool:
        m = m == 0  # an additive mask: 0 where visible, a large negative elsewhere
    return m.nonzero()[:, 0]


def block_extremes(keys: torch.Tensor, blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [Hkv, ≥ blocks·b, D] -> (max, min) over each block's keys, [Hkv, blocks, D] each (exact)."""
    hkv, _, d = keys.shape
    tiles = keys[:, : blocks * block_size].reshape(hkv, blocks, block_size, d)
    return tiles.amax(2), tiles.amin(2)


def select_blocks_for_row(
    q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, first: int, count: int
) -> torch.Tensor:
    """q [H, D]; kmax/kmin [H, n, D] over candidate blocks first..first+n-1 -> [H, count] block ids, ascending."""
    bound = torch.maximum(q[:, None, :] * kmax, q[:, None, :] * kmin).sum(-1)  # [H, n]
    return bound.topk(count, dim=-1).indices.sort(dim=-1).values + first


def sparse_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    block_size: int,
    blocks: int,
    window: int,
    sink_blocks: int,
) -> tuple[torch.Tensor, float]:
    """query [B, H, Lq, D] (new rows), key/value [B, Hkv, Lk, D] (the cache, new rows last) -> ([B, H, Lq, D],
    fraction of the visible keys attended to). `blocks` selected blocks per row and head; `window` ≥ Lq."""
    b, h, lq, _ = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    if lq > window:
        from byblock.errors import InvalidParameterError

        raise InvalidParameterError(
            f"--sparse-decode-window {window} is smaller than the {lq} rows of one forward (raise it)"
        )
    bs = block_size
    kv_head = torch.arange(h, device=query.device) // (h // hkv)
    out = torch.empty_like(query)
    kept = seen = 0
    for bi in range(b):
        shared: tuple[torch.Tensor, torch.Tensor] | None = None  # extremes over the contiguous cache prefix
        for i in range(lq):
            vis = visible_keys(attention_mask, bi, i, lq, lk)
            p = vis.numel() - 1  # the row's position: its rank among its visible keys
            end = max(0, (p - window + 1) // bs)  # candidate blocks: [sink_blocks, end)
            if end - sink_blocks > blocks:
                if bool(vis[end * bs - 1] == end * bs - 1):  # the row's first end·b keys are cache slots 0..
                    if shared is None:  # end·b <= p − W + 1 <= Lk − Lq: only committed slots are summarised
                        shared = block_extremes(key[bi], (lk - lq) // bs, bs)
                    kmax, kmin = shared[0][:, :end], shared[1][:, :end]
                else:  # padding or a compacted cache: the row's own keys, in its order
                    kmax, kmin = block_extremes(key[bi][:, vis[: end * bs]], end, bs)
                top = select_blocks_for_row(
                    query[bi, :, i], kmax[kv_head, sink_blocks:], kmin[kv_head, sink_blocks:], sink_blocks, blocks
                )
                offs = torch.arange(bs, device=query.device)
                ranks = torch.cat(
                    [
                        torch.arange(sink_blocks * bs, device=query.device).expand(h, -1),
                        (top[:, :, None] * bs + offs).flatten(1),
                        torch.arange(end * bs, p + 1, device=query.device).expand(h, -1),
                    ],
                    dim=1,
                )
                idx = vis[ranks]  # [H, n]
            else:
                idx = vis.expand(h, -1)
            kept += idx.shape[1]
            seen += p + 1
            kg = key[bi][kv_head[:, None], idx]  # [H, n, D]
            vg = value[bi][kv_head[:, None], idx]
            row = torch.nn.functional.scaled_dot_product_attention(query[bi, :, i, None], kg, vg, scale=scale)
            out[bi, :, i] = row[:, 0]
    return out, kept / max(seen, 1)
