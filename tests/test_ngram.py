"""Prompt lookup: which earlier match the n-gram drafter copies from."""

from __future__ import annotations

from byblock.drafters.ngram import find_continuations


def test_repetitive_text_gets_a_full_block_not_the_truncated_newest_match():
    tokens = [5, 6, 5, 6, 5, 6]  # query: the last 6
    assert find_continuations(tokens, n=1, length=4, limit=1) == [[5, 6, 5, 6]]
    assert find_continuations(tokens, n=1, length=4, limit=3) == [[5, 6, 5, 6], [5, 6]]


def test_newest_first_among_full_length_matches():
    tokens = [1, 9, 2, 3, 1, 9, 4, 5, 0, 0, 1, 9]
    assert find_continuations(tokens, n=2, length=2, limit=2) == [[4, 5], [2, 3]]


def test_no_match():
    assert find_continuations([1, 2, 3], n=1, length=4, limit=1) == []
    assert find_continuations([1], n=2, length=4, limit=1) == []


def test_match_starts_equals_the_tensor_scan_it_replaced():
    """The list scan finds exactly the starts the unfold-and-compare tensor scan found, for every n."""
    import random

    import torch

    from byblock.drafters.ngram import match_starts

    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        for n in (1, 2, 3):
            if len(tokens) <= n:
                assert match_starts(tokens, n) == []
                continue
            t = torch.tensor(tokens)
            want = torch.nonzero((t.unfold(0, n, 1)[:-1] == t[-n:]).all(-1)).flatten().tolist()
            assert match_starts(tokens, n) == want, (tokens, n)
