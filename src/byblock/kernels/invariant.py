"""Row-invariant bf16 inference: a token's logits do not depend on how many tokens share its forward.

Why: speculative decoding is lossless only if the target's verify forward over k tokens computes, for each
token, exactly what k plain decode steps would have. In fp32 the kernels' different summation orders for 1
row and k rows almost never flip an argmax; in bf16 they do, on most prompts (dev/LOG.md, session 2). The
same problem ("batch invariance") breaks determinism of LLM servers; the cure is the same: every reduction
must be done in an order that does not depend on the number of rows in the call.

What CPU kernels do (probed in tests/test_invariant.py and dev/LOG.md, sessions 5, 8, 9): a GEMM kernel is
chosen by shape, and different kernels sum in different orders. On the AMD EPYC (AVX512-BF16) these rules were
first found on:
- bf16 GEMM (`x @ W_t`, and batched `@`) gives bitwise the same row for any row count >= 2, but a single
  row takes a different (GEMV) path; a GEMM against a single column switches kernels at ~24 rows.
- Keys with softmax weight exactly 0 *after* a row's last real key (a chain row's future tokens) leave its
  bits unchanged; zero-weight keys *between* its keys (a tree's non-ancestors) do not — a DDTree verify on
  real activations flipped a greedy token that way (tests/data/smollm2_layer14_tree.safetensors).
- fp32 GEMMs and SDPA's kernels are *not* row-count invariant, and neither is a `sum` over a row with
  a different number of masked entries.
On an Intel Xeon with AMX, also: trailing zero keys *do* change a row's bits when they change the GEMM's K,
and a 1536-deep linear takes another kernel past 32 rows. Hence the rule followed here: every GEMM that
touches a token's row has the same K, and 2..ROW_CHUNK rows, in a plain step and in a verify.

So decode and verify forwards (those with a cached past) use `invariant_attention_forward`: scores as one
bf16 GEMM, softmax numerator exp(s - max) in fp32 rounded to bf16 (the max is exact in any order), and
numerator and denominator as bf16 GEMMs of those weights with V and with columns of ones, split per row by a
`RowPlan`: a cache prefix ending on an ALIGN-aligned cut (the same contiguous keys however the token is
computed) plus the rest of its keys gathered in plain-decoding order, zero-padded at the end to PART_B keys. Its
precision is that of transformers' eager bf16 attention. The prompt (no past) goes through SDPA: plain and
speculative decoding prefill identically, so the prompt needs no invariance and keeps the fast kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from byblock.kernels.fast_linear import InOutLinear
from byblock.kernels.ragged import BATCH_KWARG

NAME = "byblock_invariant"
ALIGN = 64  # part A of a row's keys ends on a multiple of this, at least this many slots before the row
PART_B = 2 * ALIGN  # part B's width, whatever the row: a GEMM's K picks its kernel, trailing zeros included
ROW_CHUNK = 32  # linears run on at most this many rows per GEMM (more rows can take another kernel)
SUM_COLS = 16  # ones columns of the softmax-denominator GEMM (one column takes a row-count-dependent path)


class RowInvariantLinear(nn.Module):
    """y = x W^T + b whose value for a row does not depend on how many rows x has (bf16).

    Weight kept [out, in]: for bf16, `F.linear` is as fast as or faster than the [in, out] layout at every
    row count measured here (dev/LOG.md, session 5), unlike fp32 (kernels/fast_linear.py). In decode and verify
    forwards (`state.plan` set; always when no state is given) rows go in chunks of 2..ROW_CHUNK: one row takes
    the GEMV path, and on AMX CPUs a 1536-deep GEMM with more than 32 rows takes another kernel. A prompt
    (no plan) runs as one GEMM: plain and speculative decoding prefill it identically."""

    def __init__(self, linear: nn.Module, state: RowInvariance | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().contiguous(), requires_grad=False)  # [out, in]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        rows = x.numel() // self.in_features
        if rows == 0:  # e.g. the LM head of a prefill chunk that needs no logits
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.state is not None and self.state.whole is not None:  # a packed forward of several sequences
            return self._packed(x.reshape(rows, self.in_features)).view(*x.shape[:-1], -1)
        if 2 <= rows <= ROW_CHUNK or (rows > ROW_CHUNK and self.state is not None and self.state.plan is None):
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        out = torch.cat([self._rows(flat[i : i + ROW_CHUNK]) for i in range(0, rows, ROW_CHUNK)])
        return out.view(*x.shape[:-1], self.out_features)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        """A packed forward's rows, each computed as in its own sequence's forward: the `whole` spans (a
        sequence whose lone forward runs them as one GEMM) as one GEMM each; every other row among
        2..ROW_CHUNK-row GEMMs, which give a row the same bits whichever rows it shares them with. Other rows
        than the forward's (the LM head's chosen rows) are all of the second kind."""
        state = self.state
        assert state is not None and state.whole is not None
        spans = state.whole if x.shape[0] == state.rows else ()
        y = x.new_empty(x.shape[0], self.out_features)
        free, at = [], 0
        for a, b in spans:
            free.extend(range(at, a))
            y[a:b] = F.linear(x[a:b], self.weight, self.bias)
            at = b
        free.extend(range(at, x.shape[0]))
        if free:
            idx = torch.tensor(free, device=x.device)
            rest = x[idx]
            y[idx] = torch.cat([self._rows(rest[i : i + ROW_CHUNK]) for i in range(0, len(free), ROW_CHUNK)])
        return y

    def _rows(self, x: torch.Tensor) -> torch.Tensor:  # [1..ROW_CHUNK, in] -> [same, out]
        if x.shape[0] > 1:
            return F.linear(x, self.weight, self.bias)
        # The copy must be real: a stride-0 `expand` picks yet another kernel (and is 5-10x slower).
        return F.linear(torch.cat([x, x]), self.weight, self.bias)[:1]


@dataclass(frozen=True)
class RowPlan:
    """How each row of one decode/verify forward splits its keys (the same for every layer).

    Row t of a block stands for the token at virtual slot v_t = past + depth_t (depth = its ancestors in the
    block). Its keys, in the order plain decoding would hold them, are the cached slots [0, past) and then its
    ancestors and itself. Part A = virtual slots [0, C_t) with C_t = ALIGN·⌊(v_t − ALIGN) / ALIGN⌋ (clamped
    at 0) — a prefix of the cache, the same contiguous keys whichever way the row is computed; part B = the
    rest (≤ 2·ALIGN keys), gathered per row into its own dense, zero-padded-at-the-end array."""

    cut: torch.Tensor  # [T] int64: C_t
    cuts: tuple[int, ...]  # the distinct C_t
    index: torch.Tensor  # [T, Lb] int64: the slots of part B in order (padding points at slot 0)
    valid: torch.Tensor  # [T, Lb] bool: False on the padding
    chain: bool = False  # row t sees block slots 0..t: part B is the contiguous slice [C_t, L), no gather

    @staticmethod
    def build(past: int, block_visible: torch.Tensor) -> RowPlan | None:
        """block_visible: [T, T] bool, row t sees block slot j (itself and its ancestors, slot order = path
        order). None when some row is ALIGN or more deep (then part A would reach into the block)."""
        t = block_visible.shape[0]
        depth = block_visible.sum(-1) - 1  # [T]
        if int(depth.max()) >= ALIGN:
            return None
        cut = ((past + depth - ALIGN).clamp(min=0) // ALIGN) * ALIGN  # [T]
        n_cache = past - cut  # [T] cached keys in part B
        dev = block_visible.device
        j = torch.arange(PART_B, device=dev)[
            None
        ]  # [1, Lb]: fixed width, so part B's GEMM has the same K however computed
        # k-th visible block slot of each row (stable sort puts visible slots first, in slot order)
        order = torch.sort((~block_visible).to(torch.int8), dim=-1, stable=True).indices  # [T, T]
        k = (j - n_cache[:, None]).clamp(min=0, max=t - 1)  # [T, Lb]
        in_block = j >= n_cache[:, None]
        valid = j < (n_cache + depth + 1)[:, None]
        index = torch.where(in_block, past + order.gather(1, k), cut[:, None] + j)
        index = index.masked_fill(~valid, 0)
        chain = bool(torch.equal(block_visible, torch.ones(t, t, dtype=torch.bool, device=dev).tril()))
        return RowPlan(cut, tuple(sorted(set(cut.tolist()))), index, valid, chain)


@dataclass
class RowInvariance:
    """A model's row-invariance state: the RowPlan of the forward in flight (the adapter sets it), and in a
    packed forward of several sequences (models/adapter.py forward_packed) its row count and the spans of rows
    whose lone forward runs them as one GEMM (a prompt, a block deeper than ALIGN)."""

    plan: RowPlan | None = None
    whole: tuple[tuple[int, int], ...] | None = None  # None: not a packed forward
    rows: int = 0


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., 1, K] -> [..., 2, K]: a GEMM with one row would take the GEMV path."""
    return torch.cat([x, x], dim=-2) if x.shape[-2] == 1 else x


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a's row count (dim −2) padded to at least 2; returns float32 [..., rows, N]."""
    rows = a.shape[-2]
    return (_pad_rows(a) @ b)[..., :rows, :].float()


def _row_sums(w: torch.Tensor) -> torch.Tensor:
    """Σ_k w[..., k] as a bf16 GEMM: [..., rows, K] -> float32 [..., rows, 1].

    Against SUM_COLS real columns of ones, not one: with a single column this CPU's GEMM takes another path
    once there are enough rows (24 here) and sums in another order — a 24-row verify's denominator came out
    one bf16 ulp off the same token's plain step and flipped a greedy token (dev/LOG.md, session 8). A
    stride-0 `expand` of one column would pick yet another kernel, so the ones are materialised."""
    ones = torch.ones(*w.shape[:-2], w.shape[-1], SUM_COLS, dtype=w.dtype, device=w.device)
    return _gemm(w, ones)[..., :1]


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
    The adapter leaves the forward's RowPlan in the model config's RowInvariance; without one (blocks deeper
    than ALIGN, e.g. a windowed prompt chunk) the keys are summed in one GEMM: exact, not row-invariant.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (batch := kwargs.pop(BATCH_KWARG, None)) is not None:  # a packed batch: per sequence (kernels/ragged.py)
        return batch.attend(invariant_attention_forward, module, query, key, value, scaling=scaling, **kwargs)
    bsz, heads, t, dim = query.shape
    hkv, length = key.shape[1], key.shape[2]
    if length == t:  # no past: a prompt, identical in plain and speculative decoding
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    group = heads // hkv
    scale = scaling if scaling is not None else dim**-0.5
    rows = group * t
    q = query.reshape(bsz, hkv, rows, dim)  # rows ordered (head in group, token)
    s = _gemm(q, key.transpose(-1, -2)) * scale  # [B, Hkv, rows, L]: one dot product per entry, any row count
    softcap = kwargs.get("softcap")
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.view(bsz, hkv, group, t, length)
    if attention_mask is None:
        if t > 1:
            causal = torch.ones(t, length, dtype=torch.bool, device=s.device).tril(length - t)
            s = s.masked_fill(~causal, float("-inf"))
    else:
        m = attention_mask[:, :, None, :, -length:]  # [B|1, 1, 1, T, L]: broadcast over the group
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
    # exp(s − max): the max is exact in any order; masked keys get weight exactly 0
    w = torch.exp(s - s.amax(dim=-1, keepdim=True)).to(value.dtype)  # [B, Hkv, G, T, L]
    state: RowInvariance | None = getattr(getattr(module, "config", None), "byblock_row_invariance", None)
    plan = state.plan if state is not None else None
    if plan is None or plan.index.shape[0] != t:
        w = w.view(bsz, hkv, rows, length)
        num, den = _gemm(w, value), _row_sums(w)  # [B, Hkv, rows, D], [B, Hkv, rows, 1]
    else:
        num, den = _split_sums(w, value, plan)
    out = (num / den).to(query.dtype).view(bsz, heads, t, dim)
    return out.transpose(1, 2).contiguous(), None


def _split_sums(w: torch.Tensor, value: torch.Tensor, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w·v and Σ w as part A (a cache prefix, one GEMM per distinct cut) + part B (per-row gathered keys).

    w: [B, Hkv, G, T, L] bf16 weights; value: [B, Hkv, L, D]. Returns float32 [B, Hkv, G·T, D], [.., 1]."""
    bsz, hkv, group, t, _ = w.shape
    dim = value.shape[-1]
    if plan.chain:
        return _chain_sums(w, value, plan)
    # Part B: [B, Hkv, T, G, Lb] weights, [B, Hkv, T, Lb, D] values; the GEMMs are batched per (head, row)
    wb = w.gather(-1, plan.index.expand(bsz, hkv, group, *plan.index.shape)).masked_fill(~plan.valid, 0)
    wb = wb.transpose(2, 3).contiguous()
    vb = value[:, :, plan.index]  # [B, Hkv, T, Lb, D]
    num = _gemm(wb, vb).transpose(2, 3)  # [B, Hkv, G, T, D]
    den = _row_sums(wb).transpose(2, 3)  # [B, Hkv, G, T, 1]
    for cut in plan.cuts:
        if cut == 0:
            continue
        wa = w[..., :cut].reshape(bsz, hkv, group * t, cut)
        va = value[:, :, :cut]
        na = _gemm(wa, va).view(bsz, hkv, group, t, dim)
        da = _row_sums(wa).view(bsz, hkv, group, t, 1)
        rows = (plan.cut == cut).view(1, 1, 1, t, 1)
        num = torch.where(rows, na + num, num)  # fixed order: part A + part B
        den = torch.where(rows, da + den, den)
    return num.reshape(bsz, hkv, group * t, dim), den.reshape(bsz, hkv, group * t, 1)


def _chain_sums(w: torch.Tensor, value: torch.Tensor, plan: RowPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """`_split_sums` for a chain (plain decoding included): row t's part B is the slice [C_t, C_t + PART_B).

    Its keys after the row's own slot (later block tokens) carry weight exactly 0 and come after every key of
    the row, where zeros leave the row's bits alone; so the slice equals the gathered array of the general
    path bit for bit, without gathering values (the costliest op of a 16-token verify's attention)."""
    bsz, hkv, group, t, length = w.shape
    dim = value.shape[-1]
    wr = w.view(bsz, hkv, group * t, length)
    num = den = None
    for cut in plan.cuts:
        wb, vb = wr[..., cut : cut + PART_B], value[:, :, cut : cut + PART_B]  # part B, zero-padded to PART_B
        if wb.shape[-1] < PART_B:
            wb = F.pad(wb, (0, PART_B - wb.shape[-1]))
            vb = F.pad(vb, (0, 0, 0, PART_B - vb.shape[-2]))
        nb, db = _gemm(wb, vb), _row_sums(wb)
        if cut > 0:  # fixed order: part A + part B
            nb = _gemm(wr[..., :cut], value[:, :, :cut]) + nb
            db = _row_sums(wr[..., :cut]) + db
        if num is None:
            num, den = nb, db
        else:
            rows = (plan.cut == cut).repeat(group).view(1, 1, group * t, 1)  # rows are (head in group, token)
            num, den = torch.where(rows, nb, num), torch.where(rows, db, den)
    assert num is not None and den is not None
    return num.view(bsz, hkv, group * t, dim), den.view(bsz, hkv, group * t, 1)


def enable_row_invariance(hf_model: nn.Module) -> int:
    """Make decode and verify forwards of `hf_model` row-invariant; returns how many linears were swapped.

    Linears may be nn.Linear or InOutLinear (load_model's default relayout); others are left alone.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, invariant_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    state = RowInvariance()
    for conf in {id(c): c for c in (hf_model.config, hf_model.config.get_text_config())}.values():
        conf.byblock_row_invariance = state
    count = 0
    for parent in list(hf_model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (InOutLinear, nn.Linear):
                setattr(parent, name, RowInvariantLinear(child, state))
                count += 1
    hf_model.set_attn_implementation(NAME)
    return count


def probe_row_invariance(hf_model: nn.Module, seed: int = 0) -> tuple[str, ...]:
    """Check on random data shaped like `hf_model`'s forwards that this CPU's kernels follow the rules above.

    The rules were found by probing two CPUs; another CPU's BLAS may choose kernels differently. Checks every
    distinct RowInvariantLinear shape (a row alone vs among 2, 5 and ROW_CHUNK rows) and the attention
    (each row of a 16-token chain and a 16-node tree vs that token computed alone, with 40 and 150 cached
    keys). Returns one line per violated check; empty when every check holds. Random data can miss a
    violation that real activations hit, so an empty result is evidence, not proof (tests/test_invariant.py
    also checks captured real tensors)."""
    g = torch.Generator().manual_seed(seed)
    failures: list[str] = []
    shapes: dict[tuple[int, int], RowInvariantLinear] = {}
    for m in hf_model.modules():
        if isinstance(m, RowInvariantLinear):
            shapes.setdefault((m.in_features, m.out_features), m)
    with torch.no_grad():
        for (n_in, n_out), lin in shapes.items():
            x = torch.randn(ROW_CHUNK, n_in, generator=g).to(lin.weight.dtype)
            alone = lin(x[:1])
            if not all(torch.equal(lin(x[:rows])[:1], alone) for rows in (2, 5, ROW_CHUNK)):
                failures.append(f"linear {n_in}->{n_out}: a row's bits depend on the row count")
        cfg = hf_model.config.get_text_config()
        heads = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype = next(hf_model.parameters()).dtype
        for past in (40, 150):
            for kind in ("chain", "tree"):
                if _attention_rows_differ(g, past, 16, heads, hkv, dim, dtype, tree=kind == "tree"):
                    failures.append(f"attention ({kind}, {past} cached keys): a row differs from its plain step")
    return tuple(failures)


def _attention_rows_differ(
    g: torch.Generator, past: int, n: int, heads: int, hkv: int, dim: int, dtype: torch.dtype, tree: bool
) -> bool:
    """Whether some row of an n-token verify block differs bitwise from that token decoded alone."""
    cpu = "cpu"  # the probe checks the CPU kernels these rules are for
    q = torch.randn(1, heads, n, dim, generator=g, device=cpu).to(dtype)
    k = torch.randn(1, hkv, past + n, dim, generator=g, device=cpu).to(dtype)
    v = torch.randn(1, hkv, past + n, dim, generator=g, device=cpu).to(dtype)
    visible = torch.ones(n, n, dtype=torch.bool, device=cpu).tril()
    if tree:  # a random tree: node i hangs under a random earlier node
        visible = torch.eye(n, dtype=torch.bool, device=cpu)
        for i in range(1, n):
            visible[i] |= visible[int(torch.randint(0, i, (1,), generator=g, device=cpu))]
    allowed = torch.cat([torch.ones(n, past, dtype=torch.bool, device=cpu), visible], dim=1)[None, None]
    scale = dim**-0.5
    block, _ = invariant_attention_forward(_PlanHolder(RowPlan.build(past, visible)), q, k, v, allowed, scale)
    for i in range(n):
        keys = torch.cat([torch.arange(past, device=cpu), past + visible[i].nonzero()[:, 0]])
        single = _PlanHolder(RowPlan.build(len(keys) - 1, torch.ones(1, 1, dtype=torch.bool, device=cpu)))
        one, _ = invariant_attention_forward(single, q[:, :, i : i + 1], k[:, :, keys], v[:, :, keys], None, scale)
        if not torch.equal(one[0, 0], block[0, i]):
            return True
    return False


class _PlanHolder:
    """The part of a transformers attention module `invariant_attention_forward` reads: config's RowPlan."""

    def __init__(self, plan: RowPlan | None) -> None:
        self.config = SimpleNamespace(byblock_row_invariance=RowInvariance(plan))
