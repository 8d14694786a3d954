"""DDTree (arXiv:2604.12989): one DFlash forward, many continuations, one tree verified at once.

The drafter's per-position distributions p_1..p_D (one forward, independent given the context) score a
prefix x_1..x_d by Σ_j log p_j(x_j) — the chance, under the independence surrogate, that the target follows
it. A best-first heap pops prefixes in decreasing score; since extending a prefix never raises its score,
the first N pops are the N best prefixes, which maximises the expected accepted length Σ_nodes Π p under
that surrogate. The tree's tokens are deterministic (no q), so the engine's sample-and-walk verification
keeps it lossless under sampling too.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from byblock.drafters.dflash import DFlashDrafter
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits
from byblock.verify.types import Draft, Verdict


def tree_logp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs a tree is built from: the raw draft distribution when greedy, else the processed one
    (the distribution the target will be sampled from, mirrored). logits [..., V] -> [..., V]."""
    if params.greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
    else:
        logp = process_logits(logits, params).clamp_min(1e-30).log()
    return logp.masked_fill(logp.isnan(), float("-inf"))  # a row a grammar masks entirely: no token to draft


def build_tree(logp: torch.Tensor, budget: int, top_k: int | None = None) -> tuple[list[int], list[int]]:
    """Best-first tree over per-depth log-probs [D, V]; returns (vocabulary ids, parent per node).

    Node i's parent is −1 (the root) or an earlier node; at most `budget` nodes, depth ≤ D.
    """
    depth_max, vocab = logp.shape
    k = min(budget, vocab, top_k or budget)
    vals, ids = logp.topk(k, dim=-1)  # [D, k] sorted descending
    vals_l, ids_l = vals.tolist(), ids.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    if vals_l[0][0] == float("-inf"):  # nothing allowed at depth 1
        return tokens, parents
    # heap item: (−score, tie-break, depth, rank, parent node, parent's score)
    heap = [(-vals_l[0][0], 0, 0, 0, -1, 0.0)]
    counter = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent, base = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids_l[d][r])
        parents.append(parent)
        if r + 1 < k and vals_l[d][r + 1] > float("-inf"):  # the next sibling: same parent, next rank
            heapq.heappush(heap, (-(base + vals_l[d][r + 1]), counter, d, r + 1, parent, base))
            counter += 1
        if d + 1 < depth_max and vals_l[d + 1][0] > float("-inf"):  # the first child
            heapq.heappush(heap, (neg - vals_l[d + 1][0], counter, d + 1, 0, node, -neg))
            counter += 1
    return tokens, parents


def build_tree_lazy(
    expand: Callable[[int, int, int, int], torch.Tensor], depth_max: int, budget: int, top_k: int | None = None
) -> tuple[list[int], list[int]]:
    """Best-first tree when a node's children distribution depends on its path (DominoTree).

    expand(node, parent, token, child_index) -> log-probs [V] of the node's children (node −1 is the root,
    child_index = the children's depth − 1). Called once per expanded node, in pop order, so a stateful
    expander can build on its parent's state. Same heap discipline as build_tree.
    """
    tokens: list[int] = []
    parents: list[int] = []
    sorted_children: dict[int, tuple[list[float], list[int]]] = {}

    def children_of(node: int, parent: int, token: int, child_index: int) -> tuple[list[float], list[int]]:
        logp = expand(node, parent, token, child_index)
        k = min(budget, logp.shape[-1], top_k or budget)
        vals, ids = logp.topk(k)
        sorted_children[node] = (vals.tolist(), ids.tolist())
        return sorted_children[node]

    vals0, _ = children_of(-1, -1, -1, 0)
    if vals0[0] == float("-inf"):  # nothing allowed at depth 1
        return tokens, parents
    heap = [(-vals0[0], 0, 0, -1, 0.0, 0)]  # (−score, tie, rank, parent node, parent's score, depth index)
    counter = 1
    while heap and len(tokens) < budget:
        neg, _, r, parent, base, d = heapq.heappop(heap)
        vals, ids = sorted_children[parent]
        node = len(tokens)
        tokens.append(ids[r])
        parents.append(parent)
        if r + 1 < len(vals) and vals[r + 1] > float("-inf"):
            heapq.heappush(heap, (-(base + vals[r + 1]), counter, r + 1, parent, base, d))
            counter += 1
        if d + 1 < depth_max and len(tokens) < budget:
            cv, _ = children_of(node, parent, ids[r], d + 1)
            if cv[0] > float("-inf"):
                heapq.heappush(heap, (neg - cv[0], counter, 0, node, -neg, d + 1))
                counter += 1
    return tokens, parents


class DDTreeDrafter:
    """DFlash's block distributions expanded into a best-first draft tree under a node budget."""

    name = "ddtree"

    def __init__(self, dflash: DFlashDrafter, budget: int = 32, top_k: int | None = None) -> None:
        self.dflash = dflash
        self.budget = budget
        self.top_k = top_k
        self.block_size = dflash.block_size
        self.hidden_layers = dflash.hidden_layers
        self._params = SamplingParams()

    def start(self, prompt_ids, target_hidden, params: SamplingParams, generator, adjust=None) -> None:
        """Reset the underlying DFlash state."""
        self._params = params
        self.dflash.start(prompt_ids, target_hidden, params, generator, adjust)

    def fork(self) -> DDTreeDrafter:
        """Same backbone weights and budget, its own DFlash state."""
        return DDTreeDrafter(self.dflash.fork(), self.budget, self.top_k)

    def block_request(self, tokens: list[int], max_depth: int):
        """The backbone forward the next propose() runs (see DFlashDrafter.block_request)."""
        return self.dflash.block_request(tokens, max_depth)

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """The best `budget` prefixes of the block's distributions, as one tree."""
        depth = min(self.block_size, max_depth)
        logits = self.dflash.draft_logits(tokens[-1], len(tokens) - 1, depth)  # [depth, Vd]
        # The tree is built on the host: one copy of the block's log-probs per round, not one sync per node.
        logp = tree_logp(self.dflash.marginals(logits), self._params).cpu()
        ids, parents = build_tree(logp, self.budget, self.top_k)
        return Draft.tree(self.dflash.ids_to_target(ids), parents)

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """The accepted path is a chain of depths 1..a: its features extend the context like DFlash's."""
        self.dflash.observe(verdict, target_hidden)
