"""DDTree: the best-first tree holds exactly the best prefixes; end to end it is lossless."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lossless import SAMPLING_ALPHA, greedy_outputs_match, sampling_pvalue
from tiny import make_dflash, make_target

from byblock import SamplingParams
from byblock.drafters.ddtree import DDTreeDrafter, build_tree
from byblock.drafters.dflash import DFlashDrafter


def all_prefix_scores(logp: torch.Tensor) -> dict[tuple[int, ...], float]:
    depth, vocab = logp.shape
    out = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            out[path] = sum(float(logp[j, t]) for j, t in enumerate(path))
    return out


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 4), vocab=st.integers(2, 5), budget=st.integers(1, 20), seed=st.integers(0, 10**6))
def test_tree_is_the_set_of_best_prefixes(depth, vocab, budget, seed):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, dim=-1)
    tokens, parents = build_tree(logp, budget)
    assert all(p < i for i, p in enumerate(parents))
    paths = []
    for i in range(len(tokens)):
        path, node = [], i
        while node != -1:
            path.append(tokens[node])
            node = parents[node]
        paths.append(tuple(reversed(path)))
    assert len(set(paths)) == len(paths)  # no duplicate prefix
    scores = all_prefix_scores(logp)
    best = sorted(scores.values(), reverse=True)[: len(paths)]
    assert len(paths) == min(budget, len(scores))
    torch.testing.assert_close(sorted((scores[p] for p in paths), reverse=True), best)


@pytest.mark.parametrize("budget", [1, 6, 24])
def test_ddtree_greedy_is_lossless(tiny_target, budget):
    drafter = DDTreeDrafter(DFlashDrafter(make_dflash(tiny_target, block=6), tiny_target), budget=budget)
    for prompt in ([5, 17, 33, 9], [7, 7, 7, 7, 7, 7, 12, 40]):
        greedy_outputs_match(tiny_target, prompt, SamplingParams(max_new_tokens=40), drafter)


def test_ddtree_sampling_matches_target_distribution():
    target = make_target("llama")
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4)
    prompt = [5, 17, 33, 9, 5, 17]
    drafter = DDTreeDrafter(DFlashDrafter(make_dflash(target, block=4), target), budget=8)
    assert sampling_pvalue(target, drafter, prompt, params) > SAMPLING_ALPHA
