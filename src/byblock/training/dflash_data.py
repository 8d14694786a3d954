"""Training batches for DFlash from regenerated shards: random anchors, one block per anchor, the block mask.

For a sequence x_0..x_{L-1} with the response starting at P, an anchor a ∈ [P, L−2] starts a block
[x_a, MASK × (B−1)] at positions a..a+B−1 whose labels are x_{a+1}..x_{a+B−1} (those that exist). The block
sees itself bidirectionally and the target features of positions < a — exactly what it sees at inference,
where the anchor is the last token the target has emitted but not yet processed.
Many blocks of one sequence share one pass (paper Fig. 4); blocks never see each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from byblock.errors import ByblockError

IGNORE = -100


@dataclass(frozen=True)
class Sequence:
    """One regenerated sequence."""

    tokens: torch.Tensor  # [L] int64
    prompt_len: int  # P
    hidden: torch.Tensor  # [L-1, k*H] bf16: features of every token but the last
    topk_ids: torch.Tensor  # [L-P, k] target top-k after each prefix, aligned with response tokens
    topk_logp: torch.Tensor  # [L-P, k]

    @property
    def num_anchors(self) -> int:
        """Valid anchor positions: a ∈ [P, L−2]."""
        return max(0, len(self.tokens) - 1 - self.prompt_len)


def load_shards(paths: list[Path]) -> list[Sequence]:
    """Every sequence of the given shard files (memory-mapped safetensors, materialised per sequence)."""
    from safetensors.torch import load_file

    seqs: list[Sequence] = []
    for path in paths:
        try:
            d = load_file(str(path))
        except Exception as e:  # a truncated or foreign file
            raise ByblockError(f"{path}: not a readable shard ({e})") from None
        off = d["offsets"].tolist()
        hid_off = 0
        resp_off = 0
        for i, plen in enumerate(d["prompt_lens"].tolist()):
            length = off[i + 1] - off[i]
            resp = length - plen
            seqs.append(
                Sequence(
                    tokens=d["tokens"][off[i] : off[i + 1]].long(),
                    prompt_len=plen,
                    hidden=d["hidden"][hid_off : hid_off + length - 1],
                    topk_ids=d["topk_ids"][resp_off : resp_off + resp].long(),
                    topk_logp=d["topk_logp"][resp_off : resp_off + resp].float(),
                )
            )
            hid_off += length - 1
            resp_off += resp
    return seqs


def decay_weights(block: int, gamma: float) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ) for block positions k = 1..B−1 (position 0, the anchor, has weight 0)."""
    w = torch.zeros(block)
    w[1:] = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)
    return w


def default_gamma(block: int) -> float:
    """The paper's γ: 7 for B=16, 5 for B=10, 4 for B=8; in between, interpolated (≈ B/2 − 1, at least 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block, max(1.0, block / 2 - 1))


@dataclass(frozen=True)
class Batch:
    """b sequences × A blocks of B tokens (T = A·B), context padded to C."""

    block_ids: torch.Tensor  # [b, T] target ids ([anchor, MASK...] per block)
    block_tokens: torch.Tensor  # [b, T] the true target ids at the block positions (0 past the end)
    block_pos: torch.Tensor  # [b, T]
    ctx_hidden: torch.Tensor  # [b, C, k*H]
    ctx_pos: torch.Tensor  # [b, C]
    mask: torch.Tensor  # [b, 1, T, C + T] bool
    labels: torch.Tensor  # [b, T] draft-vocab ids, IGNORE where none
    weights: torch.Tensor  # [b, T] position-decay weights (0 where no label)
    soft_ids: torch.Tensor  # [b, T, k] draft-vocab ids of the target's top-k (IGNORE where unknown)
    soft_logp: torch.Tensor  # [b, T, k] their target log-probs

    def to(self, device: torch.device) -> Batch:
        """The batch on `device`: pinned and copied asynchronously to a GPU, untouched on the CPU."""
        if device.type == "cpu":
            return self
        from dataclasses import fields

        return Batch(**{f.name: getattr(self, f.name).pin_memory().to(device, non_blocking=True) for f in fields(self)})


def sample_anchors(seq: Sequence, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchors, sorted (fewer when the response is short)."""
    n = seq.num_anchors
    take = min(count, n)
    return (seq.prompt_len + torch.randperm(n, generator=generator)[:take]).sort().values


def make_batch(
    seqs: list[Sequence],
    anchors: list[torch.Tensor],
    block: int,
    mask_token_id: int,
    to_draft: torch.Tensor,  # [V_target] draft id of each target id, IGNORE if outside the draft vocab
    weights: torch.Tensor,  # [B] decay weights
    window: int | None = None,  # sliding window over the context (DFlashConfig.sliding_window)
) -> Batch:
    """Assemble the blocks of several sequences into one padded batch. With a window, block row j (position
    a + j) sees the context positions q < a with a + j - q < window, as the drafter does at inference."""
    b = len(seqs)
    a_max = max(1, max(len(a) for a in anchors))
    t = a_max * block
    # Context only needs features before each sequence's last anchor.
    ctx_len = [int(a.max()) if len(a) else 0 for a in anchors]
    c = max(1, max(ctx_len))
    k = seqs[0].topk_ids.shape[1]
    feat = seqs[0].hidden.shape[1]
    out = {
        "block_ids": torch.full((b, t), mask_token_id, dtype=torch.long),
        "block_tokens": torch.zeros(b, t, dtype=torch.long),
        "block_pos": torch.zeros(b, t, dtype=torch.long),
        "ctx_hidden": torch.zeros(b, c, feat, dtype=seqs[0].hidden.dtype),
        "ctx_pos": torch.arange(c).expand(b, c).clone(),
        "mask": torch.zeros(b, 1, t, c + t, dtype=torch.bool),
        "labels": torch.full((b, t), IGNORE, dtype=torch.long),
        "weights": torch.zeros(b, t),
        "soft_ids": torch.full((b, t, k), IGNORE, dtype=torch.long),
        "soft_logp": torch.zeros(b, t, k),
    }
    offs = torch.arange(block)
    for i, (seq, anc) in enumerate(zip(seqs, anchors, strict=True)):
        out["ctx_hidden"][i, : ctx_len[i]] = seq.hidden[: ctx_len[i]]
        big_l = len(seq.tokens)
        for j in range(a_max):
            rows = slice(j * block, (j + 1) * block)
            q = out["mask"][i, 0, rows]  # [B, C + T] view
            q[:, c + j * block : c + (j + 1) * block] = True  # the block sees itself, both ways
            if j >= len(anc):
                continue  # padding block: sees only itself, carries no label
            a = int(anc[j])
            pos = a + offs  # [B]
            valid = pos < big_l
            out["block_ids"][i, j * block] = seq.tokens[a]
            out["block_pos"][i, rows] = pos
            out["block_tokens"][i, j * block : j * block + int(valid.sum())] = seq.tokens[pos[valid]]
            if window is None:
                q[:, :a] = True  # features strictly before the anchor
            else:
                for r in range(block):
                    q[r, max(0, a + r - window + 1) : a] = True
            lab = torch.full((block,), IGNORE, dtype=torch.long)
            lab[valid] = to_draft[seq.tokens[pos[valid]]]
            lab[0] = IGNORE
            out["labels"][i, rows] = lab
            out["weights"][i, rows] = torch.where(lab != IGNORE, weights, torch.zeros(()))
            resp = (pos - seq.prompt_len).clamp(max=len(seq.topk_ids) - 1)  # row of the target's top-k
            sid = to_draft[seq.topk_ids[resp]]  # [B, k]
            sid[~valid] = IGNORE
            sid[0] = IGNORE
            out["soft_ids"][i, rows] = sid
            out["soft_logp"][i, rows] = seq.topk_logp[resp]
    return Batch(**out)


def build_draft_vocab(seqs: list[Sequence], size: int, always: set[int]) -> tuple[torch.Tensor, float]:
    """The `size` most frequent response tokens (plus `always`), sorted; and the share of labels it covers."""
    counts: dict[int, int] = {}
    total = 0
    for s in seqs:
        resp = s.tokens[s.prompt_len :]
        ids, n = resp.unique(return_counts=True)
        for t, c in zip(ids.tolist(), n.tolist(), strict=True):
            counts[t] = counts.get(t, 0) + c
        total += len(resp)
    others = sorted((t for t in counts if t not in always), key=lambda t: -counts[t])
    chosen = set(others[: max(0, size - len(always))]) | always
    vocab = torch.tensor(sorted(chosen), dtype=torch.long)
    covered = sum(counts.get(t, 0) for t in chosen)
    return vocab, covered / max(1, total)


def target_to_draft(vocab: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """[V_target] lookup: draft id of each target id, IGNORE outside the draft vocabulary."""
    lut = torch.full((target_vocab_size,), IGNORE, dtype=torch.long)
    lut[vocab] = torch.arange(len(vocab))
    return lut


def cosine_lr(step: int, total: int, peak: float, warmup_frac: float) -> float:
    """Linear warm-up to `peak`, then cosine decay to 0 (the paper's schedule, warm-up 0.04)."""
    warm = max(1, int(total * warmup_frac))
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return peak * 0.5 * (1 + math.cos(math.pi * progress))
