"""Domino (arXiv:2605.29707): a cheap causal correction on top of DFlash's parallel block logits.

A DFlash block is drafted in parallel, so position k ignores what was drafted at 1..k−1. Domino keeps the
one backbone forward and adds, left to right, a residual computed from the tokens drafted so far:

    s_k   = GRU(E(x_a), E(x_1), ..., E(x_{k−1}))                 a small recurrent state over the block prefix
    z_k   = lm_head(h_k) + W_2 SiLU(W_1 [h_k ; s_k])               rank-r logit residual (k ≥ 2; z_1 is the base)

Only the GRU and the two projections run sequentially (microseconds per position here). Checkpoint:
`domino_head.safetensors` + `domino_config.json` beside the DFlash weights, whose config.json is left
untouched so the directory stays loadable as a plain DFlash drafter everywhere (SGLang would read
`projector_type: "domino"` in config.json as its own Domino layout, whose weight names differ). The head's
keys use SGLang's names for the same quantities (`gru_hidden_dim`, `emb_dim`, `pure_draft_prefix_len`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from byblock.drafters.ddtree import build_tree_lazy, tree_logp
from byblock.drafters.dflash import DFlashDrafter
from byblock.errors import ByblockError
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits, sample
from byblock.verify.types import Draft, Verdict

HEAD_FILE = "domino_head.safetensors"
CONFIG_FILE = "domino_config.json"


@dataclass(frozen=True)
class DominoConfig:
    """Shape of the correction head."""

    hidden_size: int
    vocab_size: int  # the drafter's (draft vocabulary size when one is used)
    gru_hidden_dim: int = 256
    emb_dim: int = 128  # the rank r of the logit residual
    pure_draft_prefix_len: int = 1  # positions 1..this use the base logits only


class DominoHead(nn.Module):
    """GRU over the block prefix + a low-rank logit residual."""

    def __init__(self, cfg: DominoConfig) -> None:
        super().__init__()
        self.config = cfg
        self.prefix_gru = nn.GRU(cfg.hidden_size, cfg.gru_hidden_dim, batch_first=True, bias=False)
        self.proj_in = nn.Linear(cfg.hidden_size + cfg.gru_hidden_dim, cfg.emb_dim, bias=False)
        self.proj_out = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        nn.init.zeros_(self.proj_out.weight)  # starts as the identity correction: Domino == DFlash at step 0

    def residual(self, h: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """[..., H] draft states and [..., G] prefix states -> [..., V] logit residuals."""
        return self.proj_out(F.silu(self.proj_in(torch.cat([h, state], dim=-1))))

    def forward(self, h: torch.Tensor, prefix_embeds: torch.Tensor) -> torch.Tensor:
        """Teacher-forced residuals for a whole block.

        h: [n, B−1, H] draft states of positions 1..B−1; prefix_embeds: [n, B−1, H] embeddings of the tokens
        at positions 0..B−2 (anchor, then the true block tokens). Returns [n, B−1, V], zero where k ≤ prefix.
        """
        states, _ = self.prefix_gru(prefix_embeds)  # [n, B−1, G]: state k−1 has read x_0..x_{k−1}
        res = self.residual(h, states)
        keep = torch.ones(res.shape[1], dtype=res.dtype, device=res.device)
        keep[: self.config.pure_draft_prefix_len] = 0
        return res * keep[None, :, None]

    def step(self, h_k: torch.Tensor, embed_prev: torch.Tensor, state: torch.Tensor | None):
        """Inference, one position: h_k [n, H], embedding of the previous token [n, H] -> (residual [n, V], state)."""
        _, new = self.prefix_gru(embed_prev[:, None], None if state is None else state[None])
        state = new[0]
        return self.residual(h_k, state), state


def save_domino(head: DominoHead, dflash_dir: str | Path) -> None:
    """Write the head and its config next to a DFlash checkpoint (bf16)."""
    from safetensors.torch import save_file

    dflash_dir = Path(dflash_dir)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(dflash_dir / HEAD_FILE))
    c = head.config
    meta = {
        "projector_type": "domino",
        "gru_hidden_dim": c.gru_hidden_dim,
        "emb_dim": c.emb_dim,
        "pure_draft_prefix_len": c.pure_draft_prefix_len,
        "vocab_size": c.vocab_size,
    }
    (dflash_dir / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def has_domino(dflash_dir: str | Path) -> bool:
    """Whether a DFlash checkpoint directory carries a Domino head."""
    return (Path(dflash_dir) / CONFIG_FILE).is_file() and (Path(dflash_dir) / HEAD_FILE).is_file()


def load_domino(dflash_dir: str | Path, hidden_size: int, dtype: torch.dtype = torch.float32) -> DominoHead:
    """The Domino head stored beside a DFlash checkpoint (a one-line error when there is none)."""
    from safetensors.torch import load_file

    dflash_dir = Path(dflash_dir)
    if not has_domino(dflash_dir):
        raise ByblockError(f"{dflash_dir} has no Domino head (train one with `byblock train domino`)")
    raw = json.loads((dflash_dir / CONFIG_FILE).read_text())
    cfg = DominoConfig(
        hidden_size=hidden_size,
        vocab_size=int(raw["vocab_size"]),
        gru_hidden_dim=int(raw["gru_hidden_dim"]),
        emb_dim=int(raw["emb_dim"]),
        pure_draft_prefix_len=int(raw.get("pure_draft_prefix_len", 1)),
    )
    head = DominoHead(cfg)
    head.load_state_dict(load_file(str(dflash_dir / HEAD_FILE)))
    return head.to(dtype).eval()


class DominoDrafter:
    """DFlash backbone + Domino correction; a chain (budget 1) or a best-first tree over corrected logits."""

    name = "domino"

    def __init__(self, dflash: DFlashDrafter, head: DominoHead, tree_budget: int = 0) -> None:
        self.dflash = dflash
        self.head = head.eval()
        self.tree_budget = tree_budget  # 0: chain
        self.block_size = dflash.block_size
        self.hidden_layers = dflash.hidden_layers
        self._params = SamplingParams()
        self._generator: torch.Generator | None = None

    def start(self, prompt_ids, target_hidden, params: SamplingParams, generator, adjust=None) -> None:
        """Reset the backbone's state."""
        self._params, self._generator = params, generator
        self.dflash.start(prompt_ids, target_hidden, params, generator, adjust)

    def fork(self) -> DominoDrafter:
        """Same backbone weights and head, its own DFlash state."""
        return DominoDrafter(self.dflash.fork(), self.head, self.tree_budget)

    def block_request(self, tokens: list[int], max_depth: int):
        """The backbone forward the next propose() runs (see DFlashDrafter.block_request)."""
        return self.dflash.block_request(tokens, max_depth)

    def _embed(self, draft_id: int) -> torch.Tensor:
        vocab = self.dflash.draft_vocab
        tid = int(vocab[draft_id]) if vocab is not None else draft_id
        return self.dflash.embed_ids([tid]).to(self.head.proj_in.weight.dtype)  # [1, H]

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """Corrected drafts: sequential over the block, one GRU step per position."""
        d = self.dflash
        depth = min(self.block_size, max_depth)
        with torch.inference_mode():
            base, h = d.draft_logits(tokens[-1], len(tokens) - 1, depth, return_hidden=True)  # [D, Vd], [D, H]
            h = h.to(self.head.proj_in.weight.dtype)
            anchor = tokens[-1]
            emb_anchor = d.embed_ids([anchor]).to(h.dtype)
            if self.tree_budget:
                return self._tree(base, h, emb_anchor, depth)
            return self._chain(base, h, emb_anchor, depth)

    def _chain(self, base, h, emb_anchor, depth) -> Draft:
        picked, qs, path = [], [], []  # path: the picked tokens as target ids (what the adjustments count)
        state = None
        prev_emb = emb_anchor
        adjust, vocab = self.dflash.adjust, self.dflash.draft_vocab
        for k in range(depth):
            res, state = self.head.step(h[k : k + 1], prev_emb, state)
            logits = base[k].float()
            if k >= self.head.config.pure_draft_prefix_len:
                logits = logits + res[0].float()
            if adjust is not None:
                logits = adjust.row(logits, path, vocab)
                if float(logits.max()) == float("-inf"):  # the grammar allows none of the draft vocabulary
                    break
            if self._params.greedy:
                t = int(logits.argmax())
            else:
                q = process_logits(logits, self._params)
                t = int(sample(q, self._generator))
                qs.append(q)
            picked.append(t)
            path.extend(self.dflash.ids_to_target([t]))
            prev_emb = self._embed(t)
        ids = torch.tensor(picked, dtype=torch.long, device=self.dflash.device)
        tokens, q = self.dflash.to_target(ids, torch.stack(qs) if qs else None)  # q: [D, V] when sampling
        return Draft.chain(tokens, q=q)

    def _tree(self, base, h, emb_anchor, depth) -> Draft:
        """DominoTree: a node's children distribution depends on its path, computed when it is expanded."""
        ctx_state: dict[int, torch.Tensor] = {}  # node -> GRU state after reading the node's token (−1: anchor)
        paths: dict[int, list[int]] = {-1: []}  # node -> its path's target ids (what the adjustments count)
        adjust, vocab = self.dflash.adjust, self.dflash.draft_vocab

        def expand(node: int, parent: int, token: int, child_index: int) -> torch.Tensor:
            prev = emb_anchor if node < 0 else self._embed(token)
            res, state = self.head.step(h[child_index : child_index + 1], prev, ctx_state.get(parent))
            ctx_state[node] = state
            logits = base[child_index].float()
            if child_index >= self.head.config.pure_draft_prefix_len:
                logits = logits + res[0].float()
            if adjust is not None:  # a node's path is known when it is expanded: its own adjustment, exactly
                if node >= 0:
                    paths[node] = [*paths[parent], *self.dflash.ids_to_target([token])]
                logits = adjust.row(logits, paths[node], vocab)
            return tree_logp(logits, self._params)

        ids, parents = build_tree_lazy(expand, depth, self.tree_budget)
        return Draft.tree(self.dflash.ids_to_target(ids), parents)

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Same context bookkeeping as the backbone."""
        self.dflash.observe(verdict, target_hidden)
