"""Hybrid tree: prompt-lookup continuations and DDTree's model candidates in one tree, one node budget.

Lookup is free and, when the answer copies the context (code, quotes, edits), right for many tokens in a
row; a trained drafter is right on new text. byblock verifies both in the same target forward: the lookup
continuation goes in first (up to the block depth), then DDTree's nodes in best-first order, merged as a
trie (a model candidate equal to a lookup node costs no budget) until the budget is spent.
"""

from __future__ import annotations

import torch

from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.ngram import NgramDrafter
from byblock.verify.types import Draft, Verdict


def merge_trees(first: Draft, second: Draft, budget: int) -> Draft:
    """Union of two drafts as tries (first's nodes first), at most `budget` nodes; parents precede children."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node

    def add(draft: Draft) -> None:
        mapped: list[int] = []
        for tok, par in zip(draft.tokens.tolist(), draft.parents.tolist(), strict=True):
            parent = -1 if par < 0 else mapped[par]
            node = -2 if parent == -2 else index.get((parent, tok))
            if node is None:
                if len(tokens) >= budget:
                    node = -2  # dropped: its subtree is dropped too
                else:
                    node = len(tokens)
                    index[(parent, tok)] = node
                    tokens.append(tok)
                    parents.append(parent)
            mapped.append(node)

    add(first)
    add(second)
    return Draft.tree(tokens, parents)


class HybridDrafter:
    """NgramDrafter + DDTreeDrafter merged under one budget."""

    name = "hybrid"

    def __init__(self, ngram: NgramDrafter, ddtree: DDTreeDrafter, budget: int = 32) -> None:
        self.ngram = ngram
        self.ddtree = ddtree
        self.budget = budget
        self.block_size = max(ngram.block_size, ddtree.block_size)
        self.hidden_layers = ddtree.hidden_layers

    def start(self, prompt_ids, target_hidden, params, generator, adjust=None) -> None:
        """Reset the model drafter (lookup is stateless)."""
        self.ddtree.start(prompt_ids, target_hidden, params, generator, adjust)

    def fork(self) -> HybridDrafter:
        """The (stateless) lookup shared, the model drafter forked."""
        return HybridDrafter(self.ngram, self.ddtree.fork(), self.budget)

    def block_request(self, tokens: list[int], max_depth: int):
        """The backbone forward the next propose() runs (see DFlashDrafter.block_request)."""
        return self.ddtree.block_request(tokens, max_depth)

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """Lookup continuation first, then the model's best-first nodes."""
        lookup = self.ngram.propose(tokens, min(max_depth, self.ddtree.block_size))
        model = self.ddtree.propose(tokens, max_depth)
        return merge_trees(lookup, model, self.budget)

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """The accepted path is a chain whatever branch it came from: the DFlash context grows the same way."""
        self.ddtree.observe(verdict, target_hidden)
