"""Sparse attention for decode and verify rows over a long cache (`--sparse-decode K`), row-local by design.

Each new row (a decoded token, or one row of a speculative verify, chain or tree) attends to:
  * the sink blocks (the first `sink_blocks` blocks of its keys),
  * its recent keys densely: every visible key from block e = ⌊(p − W + 1) / b⌋ on, p its position, W the
    decode window (so at least the W most recent positions, itself included),
  * the K key blocks in [sinks, e) with the highest Quest bound Σ_d max(q_d·max_k k_d, q_d·min_k k_d) (the
    elementwise extremes of each block's keys: an upper bound of q·k over the block), summed over the query
    heads of one KV head: the blocks are chosen per KV head, so a GQA group reads one gathered copy of its
    keys instead of one per query head (3× fewer bytes copied on SmolLM2's 9/3 heads).

Why this is lossless under speculative decoding *with respect to the sparse model*: the selectable blocks end
before p − W + 1, and W is at least the number of rows in the forward, so they only hold committed keys: a row
at position p sees the same candidate blocks, the same scores and the same recent keys whether it is decoded
alone or verified beside 31 drafted rows. Each row is computed on its own (its gathered keys, one query), so its
arithmetic does not depend on its neighbours either. Keys are ranked by their order among the row's visible
keys (the attention mask), so a tree row's ancestors stand where plain decoding would have put those tokens.
Block extremes are exact (max/min) and kept beside the cache, so a block is summarised once, when it fills
(kv/block_summary.py); without a cache at hand they are computed once per forward.

Two backends, chosen by capability: on a CPU in fp32 the row-local kernel (kernels/row_attention.py) takes
each row's chosen keys as a per-KV-head key set and reads them in place, in slot order; elsewhere (CUDA, bf16,
no compiler) the portable path gathers each row's keys into one buffer and runs SDPA on it. Both compute the
same attention (tested against each other and a brute-force reference).

The prefill of a prompt is not touched (Stem's prefill, or dense). Reference: Quest (Tang et al. 2024) for
the block bound; ../shared/reference/sparse_attention.md for the seed's framing.
"""

from __future__ import annotations

import torch

from byblock.kv.block_summary import KeyBlockSummary, block_extremes


def visible_keys(attention_mask: torch.Tensor | None, batch: int, row: int, lq: int, lk: int) -> torch.Tensor:
    """Indices of the keys query `row` of sequence `batch` may see, ascending (None mask: causal, no padding)."""
    dev = attention_mask.device if attention_mask is not None else None
    if attention_mask is None:
        return torch.arange(lk - lq + row + 1, device=dev)
    m = attention_mask[batch, 0, row] if attention_mask.shape[0] > 1 else attention_mask[0, 0, row]
    if m.dtype != torch.bool:
        m = m == 0  # an additive mask: 0 where visible, a large negative elsewhere
    return m.nonzero()[:, 0]


def select_blocks_for_row(
    q: torch.Tensor, kmax: torch.Tensor, kmin: torch.Tensor, first: int, count: int
) -> torch.Tensor:
    """q [H, D]; kmax/kmin [Hkv, n, D] over candidate blocks first..first+n-1 -> [Hkv, count] block ids,
    ascending: per KV head, the blocks with the highest Quest bound summed over the query heads it serves."""
    hkv, _, d = kmax.shape
    qg = q.reshape(hkv, -1, 1, d)  # [Hkv, G, 1, D]
    bound = torch.maximum(qg * kmax[:, None], qg * kmin[:, None]).sum(-1).sum(1)  # [Hkv, n]
    return _top_blocks(bound, count) + first


def _top_blocks(bound: torch.Tensor, count: int) -> torch.Tensor:
    """[..., n] bounds -> [..., count] indices of the highest, ascending. Ties go to the earlier block (a stable
    sort, not topk): the choice must not depend on how many candidates a call pads the row with."""
    return bound.sort(dim=-1, descending=True, stable=True).indices[..., :count].sort(dim=-1).values


def _gather_blocks(
    t: torch.Tensor, sinks: int, end: int, bs: int, top: torch.Tensor, recent: torch.Tensor | slice
) -> torch.Tensor:
    """t [Hkv, L, D] -> [Hkv, n, D]: the first `sinks` keys, the blocks `top` [Hkv, K] (ascending, < end) and
    the `recent` keys, in that order, copied once into one buffer (whole blocks by index_select: a per-key
    gather or a cat costs two to three times as much on a CPU)."""
    hkv, _, d = t.shape
    k = top.shape[1]
    n_recent = recent.stop - recent.start if isinstance(recent, slice) else recent.numel()
    out = torch.empty(hkv, sinks + k * bs + n_recent, d, dtype=t.dtype, device=t.device)
    out[:, :sinks] = t[:, :sinks]
    tiles = t[:, : end * bs].reshape(hkv, end, bs, d)
    for g in range(hkv):
        torch.index_select(tiles[g], 0, top[g], out=out[g, sinks : sinks + k * bs].view(k, bs, d))
    out[:, sinks + k * bs :] = t[:, recent]
    return out


class _Rows:
    """The block choice of every row of one forward: for row (b, i), its visible keys, its candidate end e and
    its chosen blocks [Hkv, K] (None: the row sees all its keys)."""

    def __init__(self, query, key, attention_mask, summary, block_size, blocks, window, sink_blocks, min_position):
        self.query, self.key, self.mask = query, key, attention_mask
        self.summary, self.bs, self.blocks, self.window, self.sinks = summary, block_size, blocks, window, sink_blocks
        self.min_position = min_position
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, Hkv, n, D] over the committed prefix

    def committed_extremes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(max, min) [B, Hkv, n, D] of the n full blocks before the new rows (kept or computed), once per forward:
        every row's candidate blocks lie among them."""
        if self.shared is None:
            n = (self.key.shape[2] - self.query.shape[2]) // self.bs
            summary = self.summary
            self.shared = summary.extremes(self.key, n) if summary is not None else block_extremes(self.key, n, self.bs)
        return self.shared

    def choose(self, bi: int, i: int) -> tuple[torch.Tensor, int, torch.Tensor | None, bool]:
        """-> (visible key slots, e, chosen blocks [Hkv, K] or None, whether the first e·b keys are slots 0..)."""
        lq, lk, bs = self.query.shape[2], self.key.shape[2], self.bs
        vis = visible_keys(self.mask, bi, i, lq, lk)
        p = vis.numel() - 1  # the row's position: its rank among its visible keys
        end = max(0, (p - self.window + 1) // bs)  # candidate blocks: [sinks, end)
        if end - self.sinks <= self.blocks or p < self.min_position:  # nothing to skip: every visible key
            return vis, end, None, True
        prefix = bool(vis[end * bs - 1] == end * bs - 1)
        if prefix:  # end·b <= p − W + 1 <= Lk − Lq: only committed slots are summarised
            kmax, kmin = (t[bi, :, self.sinks : end] for t in self.committed_extremes())
        else:  # padding or a compacted cache: the row's own keys, in its order
            kmax, kmin = block_extremes(self.key[bi][:, vis[: end * bs]], end, bs)
            kmax, kmin = kmax[:, self.sinks :], kmin[:, self.sinks :]
        return vis, end, select_blocks_for_row(self.query[bi, :, i], kmax, kmin, self.sinks, self.blocks), prefix


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
    summary: KeyBlockSummary | None = None,
    portable: bool = False,
    min_position: int = 0,
) -> tuple[torch.Tensor, float]:
    """query [B, H, Lq, D] (new rows), key/value [B, Hkv, Lk, D] (the cache, new rows last) -> ([B, H, Lq, D],
    fraction of the visible keys attended to). `blocks` selected blocks per row and KV head; `window` ≥ Lq.
    summary: this layer's kept block extremes (the cache's), or None to compute them here. portable: use the
    gather + SDPA path even where the CPU kernel runs (for tests and comparisons). min_position: rows at
    earlier positions see all their keys."""
    lq = query.shape[2]
    if lq > window:
        from byblock.errors import InvalidParameterError

        raise InvalidParameterError(
            f"--sparse-decode-window {window} is smaller than the {lq} rows of one forward (raise it)"
        )
    rows = _Rows(query, key, attention_mask, summary, block_size, blocks, window, sink_blocks, min_position)
    kernel = None
    if not portable and query.dtype == torch.float32 and query.is_cpu:
        from byblock.kernels.row_attention import load_row_attention

        kernel = load_row_attention()
    if kernel is not None:
        return _attend_in_place(kernel, rows, value, scale)
    return _attend_gathered(rows, value, scale)


VECTOR_ROWS = 4  # forwards of at least this many rows choose all rows at once (_key_sets_together)


def _attend_in_place(kernel, rows: _Rows, value: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """The CPU kernel over per-KV-head key sets [B, Hkv, Lq, Lk]: chosen keys are read where they lie. Both ways
    of building the key sets make the same choice for a row (the same bound values, the same stable order), so
    which one a forward takes does not change any row's bits."""
    if rows.query.shape[2] >= VECTOR_ROWS:
        keysets, kept, seen = _key_sets_together(rows)
    else:
        keysets, kept, seen = _key_sets_row_by_row(rows)
    out = kernel(rows.query, rows.key, value, keysets, scale)  # [B, Lq, H, D]
    return out.transpose(1, 2), kept / max(seen, 1)


def _key_sets_row_by_row(rows: _Rows) -> tuple[torch.Tensor, int, int]:
    """Key sets [B, Hkv, Lq, Lk] one row at a time: the least work for a decode step's single row."""
    query, key, bs, sinks = rows.query, rows.key, rows.bs, rows.sinks
    b, _, lq, _ = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    dev = query.device
    keysets = torch.zeros(b, hkv, lq, lk, dtype=torch.bool, device=dev)
    kept = seen = 0
    for bi in range(b):
        for i in range(lq):
            vis, end, top, _ = rows.choose(bi, i)
            p = vis.numel() - 1
            seen += p + 1
            if top is None:
                keysets[bi, :, i, vis] = True
                kept += p + 1
                continue
            chosen = torch.zeros(hkv, p + 1, dtype=torch.bool, device=dev)  # by rank among visible keys
            chosen[:, : sinks * bs] = True
            chosen[:, end * bs :] = True
            chosen[:, : end * bs].view(hkv, end, bs)[torch.arange(hkv, device=dev)[:, None], top] = True
            keysets[bi, :, i, vis] = chosen
            kept += (sinks + top.shape[1]) * bs + p + 1 - end * bs
    return keysets, kept, seen


def _key_sets_together(rows: _Rows) -> tuple[torch.Tensor, int, int]:
    """Key sets [B, Hkv, Lq, Lk] for every row at once (a verify's 16 rows cost one set of tensor ops, not 16):
    each row's bound over all committed blocks, the blocks at or past its own end e masked out, then the same
    stable order as a lone row's."""
    query, key, bs, sinks, k = rows.query, rows.key, rows.bs, rows.sinks, rows.blocks
    b, h, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    dev = query.device
    vis = _visibility(rows.mask, b, lq, lk, dev)  # [B, Lq, Lk]
    p = vis.sum(-1) - 1  # each row's position: its rank among its visible keys
    end = (p - rows.window + 1).clamp(min=0) // bs
    select = (end - sinks > k) & (p >= rows.min_position)
    seen = int((p + 1).sum())
    keysets = vis[:, None].expand(b, hkv, lq, lk)
    if not bool(select.any()):
        return keysets, seen, seen
    first = (end * bs - 1).clamp(min=0)  # the row's first end·b keys are slots 0.. iff it sees end·b of them
    prefix = vis.to(torch.int32).cumsum(-1).gather(-1, first[..., None])[..., 0] == end * bs
    together = select & prefix
    keysets = keysets.clone()
    if bool(together.any()):
        kmax, kmin = rows.committed_extremes()
        n = kmax.shape[2]
        qg = query.transpose(1, 2).reshape(b, lq, hkv, h // hkv, 1, d)  # [B, Lq, Hkv, G, 1, D]
        lo, hi = kmax[:, None, :, None, sinks:], kmin[:, None, :, None, sinks:]  # [B, 1, Hkv, 1, n - s, D]
        bound = torch.maximum(qg * lo, qg * hi).sum(-1).sum(-2)  # [B, Lq, Hkv, n - s], each row's own values
        past_end = torch.arange(sinks, n, device=dev) >= end[..., None, None]
        top = _top_blocks(bound.masked_fill(past_end, float("-inf")), k) + sinks  # [B, Lq, Hkv, K]
        chosen = torch.zeros(b, lq, hkv, lk // bs + 1, dtype=torch.bool, device=dev)
        chosen.scatter_(-1, top, True)
        slot = torch.arange(lk, device=dev)
        allowed = chosen.repeat_interleave(bs, dim=-1)[..., :lk]  # [B, Lq, Hkv, Lk]
        allowed |= (slot < sinks * bs) | (slot >= (end * bs)[..., None])[:, :, None]
        rows_sets = (vis[:, :, None] & allowed).transpose(1, 2)  # [B, Hkv, Lq, Lk]
        keysets = torch.where(together[:, None, :, None], rows_sets, keysets)
    for bi, i in (select & ~prefix).nonzero().tolist():  # padding or a compacted cache: row by row
        slots, row_end, row_top, _ = rows.choose(bi, i)
        assert row_top is not None
        ranks = torch.zeros(hkv, slots.numel(), dtype=torch.bool, device=dev)  # by rank among visible keys
        ranks[:, : sinks * bs] = True
        ranks[:, row_end * bs :] = True
        ranks[:, : row_end * bs].view(hkv, row_end, bs)[torch.arange(hkv, device=dev)[:, None], row_top] = True
        keysets[bi, :, i] = False
        keysets[bi, :, i, slots] = ranks
    return keysets, int(keysets[:, 0].sum()), seen  # every KV head reads as many keys


def _visibility(mask: torch.Tensor | None, b: int, lq: int, lk: int, dev) -> torch.Tensor:
    """bool [B, Lq, Lk]: the keys each row may see (None: causal new rows last, no padding)."""
    if mask is None:
        return (torch.arange(lk, device=dev) <= torch.arange(lk - lq, lk, device=dev)[:, None]).expand(b, lq, lk)
    m = mask[:, 0]
    if m.dtype != torch.bool:
        m = m == 0  # an additive mask: 0 where visible, a large negative elsewhere
    return m.expand(b, lq, lk)


def _attend_gathered(rows: _Rows, value: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """The portable path: per row, its chosen keys gathered into one buffer, one SDPA per KV head."""
    query, key, bs, sinks = rows.query, rows.key, rows.bs, rows.sinks
    b, h, lq, d = query.shape
    hkv = key.shape[1]
    dev = query.device
    heads = torch.arange(hkv, device=dev)[:, None]
    out = torch.empty_like(query)
    kept = seen = 0
    for bi in range(b):
        kb, vb = key[bi], value[bi]
        for i in range(lq):
            vis, end, top, prefix = rows.choose(bi, i)
            p = vis.numel() - 1
            if top is None:
                kg, vg = kb[:, vis], vb[:, vis]
            elif prefix:
                recent = vis[end * bs :]
                if int(recent[-1] - recent[0]) == recent.numel() - 1:  # a chain row: its recent keys are a slice
                    recent = slice(end * bs, end * bs + recent.numel())
                kg, vg = (_gather_blocks(t, sinks * bs, end, bs, top, recent) for t in (kb, vb))
            else:
                offs = torch.arange(bs, device=dev)
                ranks = torch.cat(
                    [
                        torch.arange(sinks * bs, device=dev).expand(hkv, -1),
                        (top[:, :, None] * bs + offs).flatten(1),
                        torch.arange(end * bs, p + 1, device=dev).expand(hkv, -1),
                    ],
                    dim=1,
                )
                idx = vis[ranks]  # [Hkv, n]
                kg, vg = kb[heads, idx], vb[heads, idx]
            kept += kg.shape[1]
            seen += p + 1
            # one SDPA per KV head over the query heads it serves (GQA without repeating keys)
            q = query[bi, :, i].reshape(1, hkv, h // hkv, d)
            out[bi, :, i] = torch.nn.functional.scaled_dot_product_attention(
                q, kg[None], vg[None], scale=scale
            ).reshape(h, d)
    return out, kept / max(seen, 1)
