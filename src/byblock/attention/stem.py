"""Stem sparse prefill: score key blocks cheaply, keep a position-decayed budget of them per query block,
attend only there.

Per layer (first prefill only; decode and cached chunks stay dense), with b-token blocks and n = L / b:
  1. OAM block logits (Output-Aware Metric): the strided anti-diagonal estimate of QKᵀ (stride s: each group
     of s queries, reversed, dotted with the matching s keys — XAttention's estimator, cost ≈ 1/s of QKᵀ),
     averaged over each (query block, key block) tile, plus a value bonus β·ReLU(z(log ‖v‖)) per key group
     (only keys with above-average value norm get one). AngelSlim: λ = 0.2 (torch) / 0.3 (hpc-ops).
  2. TPD budgets (Token Position Decay): base budget k = max(forced, round((1 − sparsity)·n)) key blocks;
     query blocks 0..k−1 get k (they have at most k causal blocks anyway), later ones decay from k to α·k,
     linearly (as Stem's code) or exponentially.
  3. Selection: top-budget key blocks per (batch, head, query block), OR sink blocks and a local window
     (diagonal + previous), AND causal.
  4. Attention over the selected blocks only (a gather kernel: selected key blocks are gathered per query
     block, so the cost scales with the density), causal inside the diagonal block.
Reference: ../shared/reference/sparse_attention.md §1 (Tencent/AngelSlim stem torch_impl.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch


class Backend(Enum):
    """How the selected blocks are attended to."""

    FLEX = "flex"  # torch flex_attention with a BlockMask (compiled; skips unselected blocks)
    GATHER = "gather"  # gather the selected key blocks per query block (plain PyTorch, no compiler)


class Decay(Enum):
    """How the per-query-block budget shrinks after the first k blocks."""

    LINEAR = "linear"
    EXP = "exp"


@dataclass(frozen=True)
class StemConfig:
    """Stem knobs (seed 000's deployment example: sparsity 0.75, linear TPD, OAM β 0.5)."""

    sparsity: float = 0.75  # target fraction of key blocks skipped by the base budget
    decay: Decay = Decay.LINEAR
    alpha: float = 0.7  # budget of the last query block as a fraction of the base budget
    oam_beta: float = 0.5  # weight of the value-norm bonus (0: attention estimate only)
    block_size: int = 128
    stride: int = 8
    sink_blocks: int = 1
    local_blocks: int = 2  # the diagonal block and the one before it
    dense_layers: int = 2  # the first layers stay dense
    min_tokens: int = 2048  # shorter prompts stay dense
    backend: Backend = Backend.FLEX
    # Cross-layer shared index (CLSA's training-free variant, issue 37): the block mask is chosen in the first
    # sparse layer of each group of `share_layers` and reused by the rest of the group (1: every layer its own).
    share_layers: int = 1
    prefill: bool = True  # False: prompts prefill densely (only decode is sparse)
    # Sparse decode/verify (attention/sparse_decode.py): each new row attends to the sinks, its recent keys
    # from `decode_window` positions back, and the `decode_blocks` best key blocks before them (0: dense).
    decode_blocks: int = 0
    decode_window: int = 256
    # Rows at positions below this attend densely: under ~4K tokens on a CPU choosing blocks costs more than
    # the keys it skips (benchmarks/RESULTS.md §7c). A function of the position alone, so still row-local.
    decode_min_tokens: int = 4096

    def __post_init__(self) -> None:
        from byblock.errors import InvalidParameterError

        if not 0.0 <= self.sparsity < 1.0:
            raise InvalidParameterError(f"--sparsity must be in [0, 1), got {self.sparsity}")
        if not 0.0 < self.alpha <= 1.0:
            raise InvalidParameterError("TPD alpha must be in (0, 1]")
        if self.block_size % self.stride or self.stride < 1:
            raise InvalidParameterError("the block size must be a multiple of the stride")
        if self.oam_beta < 0 or self.sink_blocks < 0 or self.local_blocks < 1 or self.dense_layers < 0:
            raise InvalidParameterError("oam_beta, sink_blocks, dense_layers >= 0 and local_blocks >= 1")
        if self.decode_blocks < 0 or self.decode_window < 1 or self.decode_min_tokens < 0:
            raise InvalidParameterError(
                "--sparse-decode and --sparse-decode-min-tokens must be >= 0 and --sparse-decode-window >= 1"
            )
        if self.share_layers < 1:
            raise InvalidParameterError(f"--sparse-share-layers must be >= 1, got {self.share_layers}")

    def index_group(self, layer: int) -> int:
        """Which shared-index group a sparse layer belongs to (layers dense_layers.. in runs of share_layers)."""
        return (layer - self.dense_layers) // self.share_layers


@dataclass
class DensityLog:
    """Fraction of the causal block triangle actually computed, per layer (last prefill)."""

    per_layer: dict[int, float] = field(default_factory=dict)
    kernel_layers: set[int] = field(default_factory=set)  # layers that ran the block-sparse kernel
    window_layers: set[int] = field(default_factory=set)  # sliding-window layers that ran the flex window kernel
    flex: Callable | None = None  # the compiled flex_attention, built on first use (per model)
    decode: dict[int, float] = field(default_factory=dict)  # per layer: fraction of visible keys a decode row read
    shared_layers: set[int] = field(default_factory=set)  # layers that reused an earlier layer's block mask
    # the last block mask chosen, as (index group, layer that chose it, mask): layers run in order within a
    # forward, so a later layer of the same group finds its group's mask here (see lookup)
    shared: tuple[int, int, torch.Tensor] | None = None

    def lookup(self, group: int, layer: int, shape: torch.Size) -> torch.Tensor | None:
        """The block mask an earlier layer of `group` chose in this forward, or None (then compute and store).

        Only a mask chosen by a *lower* layer counts: that layer ran earlier in this same forward (it always
        recomputes), so a mask left by a previous prompt of the same shape is never reused."""
        if self.shared is None:
            return None
        g, by, mask = self.shared
        return mask if g == group and by < layer and mask.shape == shape else None

    def mean(self) -> float:
        """Mean over the layers that ran sparse."""
        vals = [v for v in self.per_layer.values() if v < 1.0]
        return sum(vals) / len(vals) if vals else 1.0


def oam_block_logits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: StemConfig, scale: float) -> torch.Tensor:
    """q, k, v: [B, H, L, D] (L a multiple of the block size) -> block logits [B, H, n, n], -inf above the diagonal."""
    b, h, length, d = q.shape
    s, bs = cfg.stride, cfg.block_size
    g = length // s
    # Anti-diagonal estimate: S[i, j] = Σ_t q[s·i + s−1−t] · k[s·j + t], one GEMM over regrouped tensors.
    qg = q.view(b, h, g, s, d).flip(3).reshape(b, h, g, s * d)
    kg = k.view(b, h, g, s, d).reshape(b, h, g, s * d)
    est = (qg @ kg.transpose(-1, -2)) * (scale / s)  # [B, H, g, g]
    if cfg.oam_beta > 0:
        vnorm = v.float().norm(dim=-1).view(b, h, g, s).amax(-1).clamp_min(1e-6).log()  # [B, H, g]
        z = (vnorm - vnorm.mean(-1, keepdim=True)) / vnorm.std(-1, keepdim=True).clamp_min(1e-6)
        est = est + cfg.oam_beta * torch.relu(z)[:, :, None, :]
    per = bs // s
    n = length // bs
    logits = est.view(b, h, n, per, n, per).mean(dim=(3, 5))  # [B, H, n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return logits.masked_fill(~causal, float("-inf"))


def tpd_budgets(n: int, cfg: StemConfig) -> torch.Tensor:
    """[n] key-block budget of each query block."""
    forced = cfg.sink_blocks + cfg.local_blocks
    k = min(n, max(forced, round((1.0 - cfg.sparsity) * n)))
    budgets = torch.full((n,), k, dtype=torch.long, device="cpu")  # a schedule: host metadata
    tail = n - k
    if tail > 0:
        t = torch.linspace(0.0, 1.0, tail, device="cpu")
        if cfg.decay is Decay.LINEAR:
            vals = k * (1.0 - t * (1.0 - cfg.alpha))
        else:
            vals = k * torch.exp(t * math.log(cfg.alpha))
        budgets[k:] = vals.floor().long().clamp(1, k)
    return budgets


def select_blocks(logits: torch.Tensor, budgets: torch.Tensor, cfg: StemConfig) -> torch.Tensor:
    """Block mask [B, H, n, n] bool: top-budget blocks per query block, plus sinks and the local window, causal."""
    n, dev = logits.shape[-1], logits.device
    order = logits.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=dev).expand_as(order))
    keep = rank < budgets.to(dev).view(1, 1, n, 1)
    qi = torch.arange(n, device=dev)[:, None]
    kj = torch.arange(n, device=dev)[None, :]
    forced = (kj < cfg.sink_blocks) | ((qi - kj >= 0) & (qi - kj < cfg.local_blocks))
    causal = kj <= qi
    return (keep | forced) & causal


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    scale: float,
    chunk: int = 8,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the selected key blocks only (the gather backend).

    q, k, v: [B, H, L, D]; block_mask: [B, H, n, n] bool (causal, every row non-empty); key_valid: [B, L]
    bool or None (padding: invalid keys are never attended; a query with no valid key gets zeros).
    Returns [B, H, L, D].
    Query blocks go `chunk` at a time; each gathers its selected key blocks (padded to the row maximum with
    masked slots), so work and memory scale with the selected blocks, not with L².
    """
    b, h, length, d = q.shape
    bs = block_size
    n = length // bs
    qb = q.view(b, h, n, bs, d)
    kb = k.view(b, h, n, bs, d)
    vb = v.view(b, h, n, bs, d)
    out = torch.empty_like(qb)
    dev = q.device
    tri = torch.ones(bs, bs, dtype=torch.bool, device=dev).tril()
    for c0 in range(0, n, chunk):
        rows = block_mask[:, :, c0 : c0 + chunk]  # [B, H, c, n]
        width = int(rows.sum(-1).max())
        # indices of selected key blocks, ascending, padded with block 0 (masked below)
        sel = torch.sort(torch.where(rows, torch.arange(n, device=dev), n), dim=-1).values[..., :width]  # [B, H, c, w]
        valid = sel < n
        sel = sel.clamp_max(n - 1)
        idx = sel[..., None, None].expand(-1, -1, -1, -1, bs, d)  # [B, H, c, w, bs, D]
        src_k = kb[:, :, None].expand(-1, -1, sel.shape[2], -1, -1, -1)
        src_v = vb[:, :, None].expand(-1, -1, sel.shape[2], -1, -1, -1)
        kg = torch.gather(src_k, 3, idx).flatten(3, 4)  # [B, H, c, w·bs, D]
        vg = torch.gather(src_v, 3, idx).flatten(3, 4)
        scores = (qb[:, :, c0 : c0 + chunk] @ kg.transpose(-1, -2)) * scale  # [B, H, c, bs, w·bs]
        qblock = torch.arange(c0, c0 + sel.shape[2], device=dev).view(1, 1, -1, 1)
        diag = (sel == qblock)[..., None, :, None]  # [B, H, c, 1, w, 1]
        ok = valid[..., None, :, None] & (~diag | tri[None, None, None, :, None, :])  # causal in the diagonal
        if key_valid is not None:
            kv_ok = torch.gather(key_valid.view(b, 1, 1, n, bs).expand(-1, h, sel.shape[2], -1, -1), 3, idx[..., 0])
            ok = ok & kv_ok[..., None, :, :]  # [B, H, c, 1, w, bs]
        scores = scores.view(*scores.shape[:-1], width, bs).masked_fill(~ok, float("-inf")).flatten(-2)
        out[:, :, c0 : c0 + chunk] = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ vg
    return out.view(b, h, length, d)


def block_sparse_attention_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    scale: float,
    log: DensityLog,
) -> torch.Tensor:
    """The same attention with torch's flex_attention: the block mask becomes a BlockMask (off-diagonal
    selected blocks are "full", diagonal blocks "partial" with the causal mask_mod), so unselected blocks are
    never computed. Compiled once per model (first call per shape compiles; the CPU build uses a C++ kernel).

    Unpadded inputs only: a mask_mod that reads a padding tensor hits an inductor C++ codegen error in torch
    2.13 ("kv_indices was not declared"), so padded batches take the gather kernel (hf_stem.py)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if log.flex is None:
        log.flex = torch.compile(flex_attention, dynamic=False)
    n = block_mask.shape[-1]
    length = q.shape[2]
    diag = torch.eye(n, dtype=torch.bool, device=block_mask.device)

    def as_indices(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = sel.sum(-1).to(torch.int32)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # selected first
        return counts, order

    part_n, part_i = as_indices(block_mask & diag)
    full_n, full_i = as_indices(block_mask & ~diag)

    def mask_mod(b, h, qi, kv):
        return qi >= kv

    bm = BlockMask.from_kv_blocks(
        part_n, part_i, full_n, full_i, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(length, length)
    )
    return log.flex(q, k, v, block_mask=bm, scale=scale)


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    block_size: int,
    scale: float,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention by expanding the block mask to tokens and running dense masked attention."""
    allowed = block_mask.repeat_interleave(block_size, -1).repeat_interleave(block_size, -2)
    length = q.shape[2]
    allowed = allowed & torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0) @ v


def causal_density(block_mask: torch.Tensor) -> float:
    """Selected blocks / causal blocks (1.0 = dense)."""
    n = block_mask.shape[-1]
    return float(block_mask.float().sum() / (block_mask.shape[0] * block_mask.shape[1] * n * (n + 1) / 2))
