"""EAGLE-3 drafter: a one-layer head on the target's fused features drafts a chain, or an EAGLE-2 dynamic tree.

Per round (the engine contract; drafters/eagle3_model.py for the network):
    context  the features of committed positions not yet in the head's cache go through one step pass, each
             row reading the embedding of the token that followed it; their keys / values join the cache
    chain    the last row's logits give x̂_1; each further step reads E(x̂_d) and the previous step's output at
             the next position (keys of the drafted steps are kept only for this round)
    tree     EAGLE-2's dynamic tree: every depth expands the top-k children of the current frontier, keeps the
             k best by cumulative log-probability as the next frontier (one step pass for all of them, a tree
             mask over their drafted ancestors), and the `budget` best nodes overall form the draft
Greedy chains are argmax; sampled chains draw from the processed distribution and record q; trees are
deterministic (verification's sample-and-walk keeps them lossless under sampling).
"""

from __future__ import annotations

import copy

import torch

from byblock.drafters.ddtree import tree_logp
from byblock.drafters.eagle3_model import Eagle3DraftModel, StepKV
from byblock.drafters.features import PendingFeatures
from byblock.errors import ByblockError
from byblock.kernels.quant_embedding import embed_rows
from byblock.models.adapter import TargetModel
from byblock.sampling.draft_adjust import DraftAdjust
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits, sample
from byblock.verify.types import Draft, Verdict


def check_compatible(model: Eagle3DraftModel, target: TargetModel) -> None:
    """Refuse a head trained for another target shape (a one-line error, not a shape crash later)."""
    cfg = model.config
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} vs target {target.hidden_size}")
    if max(cfg.target_layer_ids) >= target.num_layers:
        problems.append(f"feature layers {list(cfg.target_layer_ids)} but the target has {target.num_layers}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} vs target {target.vocab_size}")
    if problems:
        raise ByblockError(f"EAGLE-3 head does not fit target '{target.name}': {'; '.join(problems)}")


class Eagle3Drafter:
    """Drafter protocol over an Eagle3DraftModel and its target's embedding."""

    name = "eagle3"

    def __init__(
        self, model: Eagle3DraftModel, target: TargetModel, depth: int = 7, budget: int = 0, top_k: int = 8
    ) -> None:
        """depth: tokens drafted per round (the chain's length, the tree's depth); budget > 0: a dynamic tree of
        at most that many nodes, expanding `top_k` children per depth; 0: a chain."""
        check_compatible(model, target)
        if depth < 1 or budget < 0 or top_k < 1:
            raise ByblockError("EAGLE-3: depth and top-k must be >= 1, the tree budget >= 0")
        self.model = model.eval()
        self.block_size = depth
        self.budget, self.top_k = budget, top_k
        self.hidden_layers = tuple(model.config.target_layer_ids)
        self.embedding = target.hf.get_input_embeddings()  # the target's own table, read through embed_rows
        self.device = target.device
        self.vocab = model.draft_vocab()  # [Vd] target ids
        self.vocab_size = target.vocab_size
        self._vocab_host: list[int] | None = None
        self._cache: list[StepKV] = []  # committed positions' keys / values, in position order
        self._pending: PendingFeatures | None = None  # features of committed positions not yet cached
        self._params = SamplingParams()
        self._generator: torch.Generator | None = None
        self._adjust: DraftAdjust | None = None  # the request's penalties / grammar, applied to the draft rows

    def start(
        self,
        prompt_ids: list[int],
        target_hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        adjust: DraftAdjust | None = None,
    ) -> None:
        """Reset; the prompt's features become the first context."""
        if target_hidden is None:
            raise ByblockError("the EAGLE-3 drafter needs the target's hidden states")
        self._cache, self._pending = [], PendingFeatures(target_hidden[0])
        self._params, self._generator, self._adjust = params, generator, adjust

    def fork(self) -> Eagle3Drafter:
        """Shares the network and embedding; fresh per-request state (set by start)."""
        clone = copy.copy(self)
        clone._cache, clone._pending = [], None
        clone._params, clone._generator, clone._adjust = SamplingParams(), None, None
        return clone

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Queue the features of the root and the accepted tokens as new context."""
        assert target_hidden is not None and self._pending is not None
        self._pending.append(target_hidden[0])

    # ---- drafting ---------------------------------------------------------------------------------------

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.embedding, ids).to(self.model.fc.weight.dtype)

    def _context(self, tokens: list[int]) -> torch.Tensor:
        """Run the pending committed positions (each reads the next committed token) -> the last row's output
        [H]: the state whose logits draft depth 1. The cache then covers positions 0 .. len(tokens) − 2."""
        assert self._pending is not None
        pending, start = self._pending.joined(), self._pending.start
        c = pending.shape[0]
        if start + c != len(tokens) - 1:
            raise RuntimeError(f"EAGLE-3 context ends at {start + c}, expected {len(tokens) - 1}")
        if c == 0:
            raise RuntimeError("EAGLE-3: no new context this round (observe was not called)")
        m = self.model
        ids = torch.tensor(tokens[start + 1 : start + 1 + c], dtype=torch.long, device=self.device)
        feats = m.fc(pending.to(m.fc.weight.dtype))[None]  # [1, C, H]
        pos = torch.arange(start, start + c, device=self.device)[None]
        out, kv = m.step(self._embed(ids)[None], feats, pos, self._cache, None)
        self._cache.append(kv)
        self._pending.consumed(start + c)
        return out[0, -1]

    def _logp(self, logits: torch.Tensor, path: list[int] | None = None) -> torch.Tensor:
        """Log-probs [Vd] of the children of the node whose path (target ids) is `path`."""
        if self._adjust is not None:
            logits = self._adjust.row(logits, path or [], self.vocab)
        return tree_logp(logits, self._params)

    def ids_to_target(self, ids: list[int]) -> list[int]:
        """Draft-vocabulary ids -> target ids (host side)."""
        if self._vocab_host is None:
            self._vocab_host = self.vocab.tolist()
        return [self._vocab_host[i] for i in ids]

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """A chain of up to `depth` tokens, or a dynamic tree, after tokens[-1]."""
        depth = min(self.block_size, max_depth)
        with torch.inference_mode():
            out = self._context(tokens)
            if self.budget:
                return self._tree(out, len(tokens) - 1, depth)
            return self._chain(out, len(tokens) - 1, depth)

    def _chain(self, out: torch.Tensor, root_pos: int, depth: int) -> Draft:
        m, drafted, qs = self.model, [], []
        past = list(self._cache)
        greedy = self._params.greedy
        for d in range(depth):
            logits = m.logits(out)  # [Vd]
            if self._adjust is not None:  # the row after the committed output and the chain so far
                logits = self._adjust.row(logits, self.ids_to_target(drafted), self.vocab)
                if float(logits.max()) == float("-inf"):  # the grammar allows none of the draft vocabulary
                    break
            if greedy:
                x = int(logits.argmax())
            else:
                q_small = process_logits(logits, self._params)
                x = int(sample(q_small, self._generator))
                q = torch.zeros(self.vocab_size, device=q_small.device)
                q[self.vocab] = q_small
                qs.append(q)
            drafted.append(x)
            if d + 1 == depth:
                break
            ids = self.vocab[x : x + 1]
            pos = torch.tensor([[root_pos + d]], device=self.device)
            # The step at root_pos + d reads the token drafted for root_pos + d + 1 and sees every committed
            # position plus the drafted steps before it.
            h, kv = m.step(self._embed(ids)[None], out[None, None], pos, past, None)
            past.append(kv)
            out = h[0, 0]
        tokens = self.ids_to_target(drafted)
        return Draft.chain(tokens, q=torch.stack(qs) if qs else None)

    def _tree(self, out: torch.Tensor, root_pos: int, depth: int) -> Draft:
        m, k = self.model, self.top_k
        committed = sum(kv.k.shape[2] for kv in self._cache)
        past = list(self._cache)
        # Nodes: draft-vocab id, parent node (-1: root), cumulative log-prob, the row of its step's output.
        node_ids: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        logp = self._logp(m.logits(out))  # [Vd]: depth 1
        vals, ids = logp.topk(min(k, logp.numel()))
        frontier = []  # node indices whose children the next step scores
        for v, i in zip(vals.tolist(), ids.tolist(), strict=True):
            if v == float("-inf"):  # refused by the grammar
                break
            frontier.append(len(node_ids))
            node_ids.append(i)
            parents.append(-1)
            scores.append(v)
        frontier_out = out[None].expand(len(frontier), -1)  # each depth-1 node reads the root row's output
        drafted_rows: list[int] = []  # node index of every drafted key column, in column order
        for d in range(1, depth):
            n = len(frontier)
            if not n:
                break
            ids_t = self.vocab[torch.tensor([node_ids[f] for f in frontier], device=self.device)]
            pos = torch.full((1, n), root_pos + d - 1, device=self.device)
            # Row r (frontier node f) sees every committed key, the drafted keys of f's ancestors, and itself.
            cols = len(drafted_rows)
            mask = torch.zeros(1, 1, n, committed + cols + n, dtype=torch.bool, device=self.device)
            mask[..., :committed] = True
            for r, f in enumerate(frontier):
                anc, a = set(), parents[f]
                while a >= 0:
                    anc.add(a)
                    a = parents[a]
                for c, node in enumerate(drafted_rows):
                    if node in anc:
                        mask[0, 0, r, committed + c] = True
                mask[0, 0, r, committed + cols + r] = True
            h, kv = m.step(self._embed(ids_t)[None], frontier_out[None], pos, past, mask)
            past.append(kv)
            drafted_rows.extend(frontier)
            child_logits = m.logits(h[0])  # [n, Vd]
            if self._adjust is None:
                child_logp = self._logp(child_logits)
            else:  # each frontier node's children after its own path
                child_logp = torch.stack(
                    [
                        self._logp(r, self._path(f, node_ids, parents))
                        for f, r in zip(frontier, child_logits, strict=True)
                    ]
                )
            base = torch.tensor([scores[f] for f in frontier], device=child_logp.device)[:, None]
            top_v, top_i = child_logp.topk(min(k, child_logp.shape[-1]), dim=-1)  # [n, k]
            cand = (base + top_v).flatten()
            keep_v, keep = cand.topk(min(k, cand.numel()))
            new_frontier, rows = [], []
            for v, c in zip(keep_v.tolist(), keep.tolist(), strict=True):
                if v == float("-inf"):  # refused by the grammar
                    break
                r, j = divmod(c, top_i.shape[1])
                new_frontier.append(len(node_ids))
                node_ids.append(int(top_i[r, j]))
                parents.append(frontier[r])
                scores.append(v)
                rows.append(r)
            frontier, frontier_out = new_frontier, h[0, rows]
        return self._select(node_ids, parents, scores)

    def _path(self, node: int, node_ids: list[int], parents: list[int]) -> list[int]:
        """The target ids on the path from the root to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node_ids[node])
            node = parents[node]
        return self.ids_to_target(path[::-1])

    def _select(self, node_ids: list[int], parents: list[int], scores: list[float]) -> Draft:
        """The `budget` best nodes by cumulative log-prob, in creation order (topological). Adding a log-prob
        (<= 0) never raises a float, so a child never outscores its parent, and ties go to the earlier node:
        the parent sorts first and the kept set is ancestor-closed."""
        order = sorted(range(len(node_ids)), key=lambda i: (-scores[i], i))[: self.budget]
        index: dict[int, int] = {}
        kept = []
        for i in sorted(order):
            if parents[i] < 0 or parents[i] in index:  # always true (see above); kept as a guard
                index[i] = len(kept)
                kept.append(i)
        tokens = self.ids_to_target([node_ids[i] for i in kept])
        return Draft.tree(tokens, [index[parents[i]] if parents[i] >= 0 else -1 for i in kept])
