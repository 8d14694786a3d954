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
