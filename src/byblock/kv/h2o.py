"""H2O (Heavy-Hitter Oracle, arXiv 2306.14048): a KV cache of at most `heavy + recent` slots per KV head.

The rule, as in the authors' real-drop implementation (`H2OKVCache_LayerWise`): every layer keeps, per KV
head, a running sum of the attention each cached token has received (summed over queries and over the query
heads of the group). After each forward, if a head holds more than `heavy + recent` slots, it keeps its
`recent` newest slots and the `heavy` others with the largest accumulated score; the rest are evicted for
good. The prompt is processed densely and evicted once at its end; decoding evicts after every token. Heads
keep different tokens, so the cache is gathered per head (slot j of head h is whatever head h kept).

Speculative decoding, exactly: plain decoding evicts between tokens, so a verify block must show each of its
queries the cache *that query* would have seen. `h2o_nodes` walks the block's nodes in order — a chain or a
tree, each node starting from its parent's state — with one small attention per node (the projections and
MLPs stay batched), and records each node's post-eviction state. The engine then commits the state of the
last accepted node (KVCache.commit). Greedy output is token-identical to plain H2O decoding and sampled
output equal in law (tests/test_h2o.py): lossless with respect to the H2O model, not the full-cache one.

Sliding-window layers (gemma3) are compressed the same way, with their window applied as a mask and
out-of-window tokens evicted first (no later query can see them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NAME = "byblock_h2o"
PREFILL_CHUNK = 256  # query rows per chunk when summing the prompt's attention (bounds memory at long prompts)


@dataclass(frozen=True)
class H2OConfig:
    """Slots kept per KV head: `heavy` heavy hitters + the `recent` newest tokens."""

    heavy: int = 256
    recent: int = 256

    def __post_init__(self) -> None:
        if self.heavy < 0 or self.recent < 1:
            raise ValueError("H2O needs heavy >= 0 and recent >= 1")

    @property
    def budget(self) -> int:
        """Slots per KV head once the cache is full."""
        return self.heavy + self.recent


@dataclass(frozen=True)
class HeadState:
    """One layer's kept slots after a node: indices into that forward's [past + T] key axis, their scores and
    absolute positions. All [Hkv, n]."""

    slots: torch.Tensor  # int64
    scores: torch.Tensor  # float32
    pos: torch.Tensor  # int64


@dataclass
class H2OState:
    """The H2O bookkeeping of one KV cache: per layer, the scores and positions of the cached slots; and,
    between a forward and its commit, every node's post-eviction state."""

    cfg: H2OConfig | None  # None: never evict after the prompt (SnapKV's one-shot selection on sliding models)
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, L] float32
    pos: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hkv, L] int64
    pending: dict[int, list[HeadState]] = field(default_factory=dict)  # layer -> one state per node
    pending_past: int = 0  # slots cached before the pending forward


@dataclass
class H2ORuntime:
    """What the attention function needs to know about the forward in flight (set by TargetModel.forward).

    With `snap` set the same per-head machinery runs SnapKV instead: the prompt's slots are chosen once by
    SnapKV's observation window and decoding never evicts (used on sliding-window models, whose window must
    be applied per head once heads keep different positions)."""

    cfg: H2OConfig | None
    snap: object = None  # SnapKVConfig
    active: H2OState | None = None  # None: plain SDPA (a cache without H2O, e.g. a cost probe)
    positions: torch.Tensor | None = None  # [T] absolute positions of the new tokens
    parents: list[int] | None = None  # tree parent of each new token (-1: the cache); None = a chain


def evict(scores: torch.Tensor, pos: torch.Tensor, cfg: H2OConfig, horizon: int | None) -> torch.Tensor:
    """Slots to keep, increasing, [Hkv, min(n, budget)]: the `recent` newest plus the `heavy` best-scored.

    scores [Hkv, n] accumulated attention; pos [Hkv, n] positions; horizon: on a sliding-window layer, the
    smallest position any later query can still see (older slots go first, whatever their score)."""
    n = scores.shape[1]
    keep_all = torch.arange(n, device=scores.device).expand(scores.shape[0], n)
    if n <= cfg.budget:
        return keep_all
    candidates = scores[:, : n - cfg.recent]
    if horizon is not None:
        candidates = candidates.masked_fill(pos[:, : n - cfg.recent] < horizon, float("-inf"))
    heavy = candidates.topk(cfg.heavy, dim=-1).indices.sort(-1).values  # [Hkv, heavy]
    return torch.cat([heavy, keep_all[:, n - cfg.recent :]], dim=-1)


def _apply(state: HeadState, keep: torch.Tensor) -> HeadState:
    return HeadState(state.slots.gather(1, keep), state.scores.gather(1, keep), state.pos.gather(1, keep))


def h2o_nodes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    base: HeadState,
    positions: torch.Tensor,
    parents: list[int],
    cfg: H2OConfig | None,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, list[HeadState]]:
    """Attention for T new tokens of one layer, each over the H2O cache its own decoding step would see.

    query [H, T, D]; key/value [Hkv, P+T, D] (cached slots then the new tokens); base: the cache's state
    (slots 0..P-1); positions [T]; parents[i] < i, or -1 for a token that directly follows the cache;
    cfg None: no eviction. Returns the output [H, T, D] and each node's state after its own eviction."""
    hkv, _, d = key.shape
    groups = query.shape[0] // hkv
    past = key.shape[1] - query.shape[1]
    out = torch.empty_like(query)
    states: list[HeadState] = []
    for i, parent in enumerate(parents):
        prev = base if parent < 0 else states[parent]
        q_pos = int(positions[i])
        dev = prev.slots.device
        cur = HeadState(
            torch.cat([prev.slots, torch.full((hkv, 1), past + i, device=dev)], 1),
            torch.cat([prev.scores, torch.zeros(hkv, 1, device=dev)], 1),
            torch.cat([prev.pos, torch.full((hkv, 1), q_pos, device=dev)], 1),
        )  # [Hkv, n]
        idx = cur.slots[..., None].expand(-1, -1, d)
        k, v = key.gather(1, idx), value.gather(1, idx)  # [Hkv, n, D]
        logits = (query[:, i].view(hkv, groups, d) @ k.transpose(1, 2)).float() * scale  # [Hkv, G, n]
        if window is not None:
            logits = logits.masked_fill((q_pos - cur.pos >= window)[:, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1)  # [Hkv, G, n]
        out[:, i] = (weights.to(v.dtype) @ v).view(-1, d)
        cur = HeadState(cur.slots, cur.scores + weights.sum(1), cur.pos)
        if cfg is None:
            states.append(cur)
            continue
        horizon = None if window is None else q_pos + 2 - window
        states.append(_apply(cur, evict(cur.scores, cur.pos, cfg, horizon)))
    return out, states


def prefill_scores(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, scale: float, window: int | None):
    """Accumulated attention [Hkv, T] each prompt token receives from the (causal, windowed) prompt queries.

    query [H, T, D], key [Hkv, T, D]; computed in query chunks so no [H, T, T] matrix is ever held."""
    hkv, t, d = key.shape
    groups = query.shape[0] // hkv
    acc = torch.zeros(hkv, t, device=key.device)
    for c0 in range(0, t, PREFILL_CHUNK):
        c1 = min(t, c0 + PREFILL_CHUNK)
        q = query[:, c0:c1].reshape(hkv, groups * (c1 - c0), d)
        logits = (q @ key[:, :c1].transpose(1, 2)).float().view(hkv, groups, c1 - c0, c1) * scale
        qp, kp = positions[c0:c1, None], positions[None, :c1]
        visible = kp <= qp
        if window is not None:
            visible &= qp - kp < window
        weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        acc[:, :c1] += weights.sum((1, 2))
    return acc


def h2o_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: SDPA for the prompt (plus its scores), per-node H2O afterwards."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rt: H2ORuntime = module.config.byblock_h2o
    state = rt.active
    if state is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    if query.shape[0] != 1:
        raise ValueError("an H2O cache decodes one sequence at a time")
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    t = query.shape[2]
    past = key.shape[2] - t
    positions = rt.positions
    state.pending_past = past
    if past == 0:  # the prompt: dense, then one eviction at its end (as the reference does)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
        hkv = key.shape[1]
        full_pos = positions.expand(hkv, t)
        if rt.snap is not None:
            from byblock.kv.snapkv import select_positions

            sel = select_positions(query, key, rt.snap, scale)  # [1, Hkv, kept] or None (prompt too short)
            keep = sel[0] if sel is not None else torch.arange(t, device=key.device).expand(hkv, t)
            zero = torch.zeros(keep.shape, device=key.device)
            state.pending[layer] = [HeadState(keep, zero, full_pos.gather(1, keep))]
            return out, None
        scores = prefill_scores(query[0], key[0], positions, scale, window)
        full = HeadState(torch.arange(t, device=key.device).expand(hkv, t), scores, full_pos)
        horizon = None if window is None else int(positions[-1]) + 2 - window
        state.pending[layer] = [_apply(full, evict(scores, full.pos, state.cfg, horizon))]
        return out, None
    slots = torch.arange(past, device=key.device).expand(key.shape[1], past)
    base = HeadState(slots, state.scores[layer], state.pos[layer])
    parents = rt.parents if rt.parents is not None else list(range(-1, t - 1))
    out, states = h2o_nodes(query[0], key[0], value[0], base, positions, parents, state.cfg, scale, window)
    state.pending[layer] = states
    return out.transpose(0, 1)[None], None  # [1, T, H, D] like sdpa_attention_forward


def tree_parents(tree_mask: torch.Tensor) -> list[int]:
    """Parent of each node from an ancestor-or-self mask [T, T] (nodes in topological order; root -> -1)."""
    strict = tree_mask.clone()
    strict.fill_diagonal_(False)
    idx = torch.arange(tree_mask.shape[0], device=tree_mask.device)
    return [int(idx[row].max()) if row.any() else -1 for row in strict]


def enable_h2o(hf_model: torch.nn.Module, cfg: H2OConfig | None, snap=None) -> H2ORuntime:
    """Switch a transformers model to the H2O attention function; returns the runtime the adapter drives.

    cfg None + snap (a SnapKVConfig): SnapKV's one-shot selection through the per-head path instead."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, h2o_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    if cfg is None and snap is None:
        raise ValueError("enable_h2o needs an H2OConfig or a SnapKVConfig")
    rt = H2ORuntime(cfg, snap)
    tc = hf_model.config.get_text_config()
    for conf in {id(c): c for c in (hf_model.config, tc)}.values():
        conf.byblock_h2o = rt
    hf_model.set_attn_implementation(NAME)
    return rt
