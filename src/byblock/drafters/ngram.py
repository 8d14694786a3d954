"""Prompt lookup / n-gram drafting (Saxena 2023; vLLM `ngram`, HF `prompt_lookup_num_tokens`).

Match the last n tokens of the context (n from max_n down to min_n) against earlier positions of
prompt + output and propose what followed. With num_candidates > 1 the distinct continuations of the
most recent matches are merged into a trie (shared prefixes share nodes) and verified as one tree.
"""

from __future__ import annotations

from dataclasses import dataclass

from byblock.drafters.base import StatelessDrafter
from byblock.errors import InvalidParameterError
from byblock.verify.types import Draft


@dataclass(frozen=True)
class NgramConfig:
    """Prompt-lookup knobs."""

    block_size: int = 8  # deepest continuation proposed
    min_n: int = 1
    max_n: int = 3
    num_candidates: int = 1  # > 1 makes a tree of that many continuations
    tree_budget: int = 31  # node cap for trees (+ the root = 32 verify rows, one ROW_CHUNK)

    def __post_init__(self) -> None:
        if self.block_size < 1 or not 1 <= self.min_n <= self.max_n:
            raise InvalidParameterError("ngram needs block_size >= 1 and 1 <= min_n <= max_n")
        if self.num_candidates < 1 or self.tree_budget < 1:
            raise InvalidParameterError("ngram needs num_candidates >= 1 and tree_budget >= 1")


def find_continuations(tokens: list[int], n: int, length: int, limit: int) -> list[list[int]]:
    """Continuations (up to `length` tokens) after earlier occurrences of the last n tokens.

    Longest first, newest first among equal lengths: in repetitive text the newest match sits right before
    the query and its continuation is cut short by the end of the context, while a slightly older match
    offers a full block. Distinct continuations only; at most `limit`. O(len(tokens)) per call.
    """
    hits = match_starts(tokens, n)
    out: list[list[int]] = []
    candidates = sorted((tokens[s + n : s + n + length] for s in reversed(hits)), key=len, reverse=True)
    for cont in candidates:
        if cont and cont not in out:
            out.append(cont)
            if len(out) >= limit:
                break
    return out


def match_starts(tokens: list[int], n: int) -> list[int]:
    """Ascending starts s of the earlier n-grams equal to the last n tokens (the final n-gram, the query itself,
    excluded). The scan for the last token runs in `list.index` (C), then each candidate's n-gram is compared:
    a per-round cost of a few microseconds, where a tensor of the history cost ~50 per n (a batched round pays
    it once per request)."""
    size = len(tokens)
    if size <= n:
        return []
    last, key, hits = tokens[-1], tokens[size - n :], []
    end = n - 1  # index of a candidate n-gram's last token: n - 1 .. size - 2
    while True:
        try:
            end = tokens.index(last, end, size - 1)
        except ValueError:
            return hits
        if tokens[end - n + 1 : end + 1] == key:
            hits.append(end - n + 1)
        end += 1


def trie_draft(continuations: list[list[int]], budget: int) -> Draft:
    """Merge continuations into a prefix tree of at most `budget` nodes (earlier ones take priority)."""
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        parent = -1
        for tok in cont:
            node = index.get((parent, tok))
            if node is None:
                if len(tokens) >= budget:
                    break
                node = len(tokens)
                index[(parent, tok)] = node
                tokens.append(tok)
                parents.append(parent)
            parent = node
    return Draft.tree(tokens, parents)


class NgramDrafter(StatelessDrafter):
    """Training-free drafter copying continuations from the context."""

    name = "ngram"

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()
        self.block_size = self.config.block_size

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """Longest-n match first; a chain, or a trie when num_candidates > 1."""
        cfg = self.config
        depth = min(cfg.block_size, max_depth)
        for n in range(cfg.max_n, cfg.min_n - 1, -1):
            conts = find_continuations(tokens, n, depth, cfg.num_candidates)
            if conts:
                if cfg.num_candidates == 1:
                    return Draft.chain(conts[0])
                return trie_draft(conts, cfg.tree_budget)
        return Draft.empty()
