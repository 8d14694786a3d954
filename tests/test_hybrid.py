"""Hybrid lookup + DDTree trees: the merge is a budgeted trie union; end to end it is lossless."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lossless import greedy_outputs_match
from tiny import make_dflash

from byblock import SamplingParams
from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.hybrid import HybridDrafter, merge_trees
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.verify.types import Draft


def paths(d: Draft) -> list[tuple[int, ...]]:
    out = []
    toks, pars = d.tokens.tolist(), d.parents.tolist()
    for i in range(len(toks)):
        p, node = [], i
        while node != -1:
            p.append(toks[node])
            node = pars[node]
        out.append(tuple(reversed(p)))
    return out


def random_tree(draw_ints: list[int]) -> Draft:
    toks, pars = [], []
    for i, x in enumerate(draw_ints):
        toks.append(x % 3)
        pars.append(-1 if i == 0 else (x // 3) % (i + 1) - 1)
    return Draft(tokens=torch.tensor(toks, dtype=torch.long), parents=torch.tensor(pars, dtype=torch.long))


@settings(max_examples=100, deadline=None)
@given(
    a=st.lists(st.integers(0, 1000), max_size=8),
    b=st.lists(st.integers(0, 1000), max_size=8),
    budget=st.integers(1, 12),
)
def test_merge_is_a_budgeted_trie_union(a, b, budget):
    first, second = random_tree(a), random_tree(b)
    merged = merge_trees(first, second, budget)
    mp = paths(merged)
    assert len(mp) == len(set(mp)) <= budget
    assert all(p < i for i, p in enumerate(merged.parents.tolist()))
    union = set(paths(first)) | set(paths(second))
    assert set(mp) <= union
    first_paths = list(dict.fromkeys(paths(first)))
    assert set(first_paths[:budget]) <= set(mp)  # the lookup branch goes in first
    if len(union) <= budget:
        assert set(mp) == union


def test_hybrid_greedy_is_lossless(tiny_target):
    ddtree = DDTreeDrafter(DFlashDrafter(make_dflash(tiny_target, block=6), tiny_target), budget=10)
    drafter = HybridDrafter(NgramDrafter(NgramConfig(block_size=5)), ddtree, budget=12)
    for prompt in ([5, 17, 33, 9, 5, 17, 33], [7, 7, 7, 7, 7, 7, 12, 40]):
        _, spec = greedy_outputs_match(tiny_target, prompt, SamplingParams(max_new_tokens=40), drafter)
        assert spec.stats.rounds > 0
