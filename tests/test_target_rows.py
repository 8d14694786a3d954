"""Logits computed on first read (verify/rows.py): same verdicts as dense logits, the head run only where read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from byblock.kv.kv_cache import KVCache
from byblock.sampling.params import SamplingParams
from byblock.verify import Draft, TargetRows, verify
from byblock.verify.rows import FIRST_ROWS
from tests.test_verify import random_tree
from tests.tiny import make_target


class ExactHead:
    """x @ W^T over small integers: exact in fp32 whatever the row count, so lazy and dense rows are equal."""

    def __init__(self, vocab: int, hidden: int, g: torch.Generator) -> None:
        self.w = torch.randint(-3, 4, (vocab, hidden), generator=g).float()
        self.rows_seen: list[list[int]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows_seen.append(x[:, 0].long().tolist())  # column 0 carries the row index (see rows_for)
        return x @ self.w.T


def rows_for(draft: Draft, vocab: int, g: torch.Generator) -> tuple[TargetRows, torch.Tensor, ExactHead]:
    n = draft.num_nodes + 1
    final = torch.randint(-3, 4, (n, 6), generator=g).float()
    final[:, 0] = torch.arange(n).float()  # a row's index, so the head can report what it computed
    head = ExactHead(vocab, 6, g)
    dense = final @ head.w.T
    return TargetRows(final, head, draft.children(), vocab), dense, head


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 20), st.integers(2, 6), st.booleans(), st.integers(0, 10**6), st.sampled_from(["greedy", "t1", "q"])
)
def test_lazy_rows_give_the_dense_verdict(n, vocab, chain, seed, mode):
    g = torch.Generator().manual_seed(seed)
    draft = random_tree(n, vocab, g, chain or mode == "q")
    params = SamplingParams(temperature=0.0) if mode == "greedy" else SamplingParams(temperature=1.0, top_p=0.9)
    if mode == "q":
        q = torch.randn(n, vocab, generator=g).softmax(-1)
        draft = Draft.chain(torch.multinomial(q, 1, generator=g).squeeze(-1) if n else draft.tokens, q=q)
    lazy, dense, head = rows_for(draft, vocab, g)
    seed_v = int(torch.randint(0, 2**31, (1,), generator=g))
    got = verify(draft, lazy, params, torch.Generator().manual_seed(seed_v))
    want = verify(draft, dense, params, torch.Generator().manual_seed(seed_v))
    assert got == want
    assert len(head.rows_seen) <= 2  # the first rows, then at most one subtree
    seen = [r for batch in head.rows_seen for r in batch]
    assert len(seen) == len(set(seen))  # no row computed twice


class ScriptedHead:
    """The target's argmax per row, scripted; rows are one-hot states, so the head sees which rows it computes."""

    def __init__(self, says: dict[int, int], vocab: int) -> None:
        self.says, self.vocab = says, vocab
        self.calls: list[list[int]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [k, N+1] one-hot rows -> [k, V]
        rows = x.argmax(-1).tolist()
        self.calls.append(rows)
        out = torch.zeros(len(rows), self.vocab)
        for i, r in enumerate(rows):
            out[i, self.says.get(r, 0)] = 1.0
        return out


def scripted_verify(draft: Draft, says: dict[int, int], vocab: int):
    head = ScriptedHead(says, vocab)
    final = torch.eye(draft.num_nodes + 1)
    verdict = verify(draft, TargetRows(final, head, draft.children(), vocab), SamplingParams(temperature=0.0), None)
    return verdict, head.calls


def test_a_short_acceptance_runs_the_head_once_on_the_first_rows():
    draft = Draft.chain(torch.arange(1, 17))  # tokens 1..16
    verdict, calls = scripted_verify(draft, {0: 1, 1: 2, 2: 0}, 17)
    assert verdict.tokens == [1, 2, 0] and calls == [list(range(FIRST_ROWS))]


def test_a_full_acceptance_runs_the_head_twice():
    draft = Draft.chain(torch.arange(1, 17))
    verdict, calls = scripted_verify(draft, {r: r + 1 for r in range(16)}, 17)
    assert verdict.num_accepted == 16 and calls == [list(range(FIRST_ROWS)), list(range(FIRST_ROWS, 17))]


def test_a_miss_computes_only_the_subtree_of_the_row_read():
    """root ─ a(0) ─ b(1) ─ c(2)            rows 0..3 first; reading row 5 (node 4) computes rows 5, 6, 7
    └─ d(3) ─ e(4) ─ f(5)
                   └─ h(6)"""
    draft = Draft(tokens=torch.tensor([1, 2, 3, 4, 5, 6, 7]), parents=torch.tensor([-1, 0, 1, -1, 3, 4, 4]))
    lazy, dense, head = rows_for(draft, 8, torch.Generator().manual_seed(1))
    assert torch.equal(lazy[0], dense[0]) and head.rows_seen == [[0, 1, 2, 3]]
    assert torch.equal(lazy[5], dense[5])
    assert head.rows_seen[1] == [5, 6, 7] and lazy.computed == 7
    assert torch.equal(lazy[7], dense[7]) and lazy.head_calls == 2


def test_the_walk_reads_down_one_branch():
    """The target follows d(3) -> e(4) -> h(6): row 4 (node d) is past the first rows: d's subtree, rows 4..7."""
    draft = Draft(tokens=torch.tensor([1, 2, 3, 4, 5, 6, 7]), parents=torch.tensor([-1, 0, 1, -1, 3, 4, 4]))
    verdict, calls = scripted_verify(draft, {0: 4, 4: 5, 5: 7, 7: 0}, 8)
    assert verdict.path == [3, 4, 6] and verdict.tokens == [4, 5, 7, 0]
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("packed", [False, True])
def test_deferred_forward_equals_the_full_one(packed):
    """defer_logits: after the first forward checks the head, forwards return the normed states; the head over
    any subset of rows gives the full forward's logits (bit for bit on the packed GEMM, which is row-invariant)."""
    target = make_target("llama", packed=packed)
    ids = torch.randint(5, 300, (1, 30), generator=torch.Generator().manual_seed(0))
    caches = [KVCache(), KVCache()]
    for c in caches:
        target.forward(ids[:, :20], c, logits_to_keep=1)
    first = target.forward(ids[:, 20:25], caches[0], defer_logits=True)
    if target.decoder is None:  # transformers' modules: this first forward checked that deferring is exact
        assert first.logits is not None and first.final is None
    else:  # byblock's own decoder applies the head itself: it defers from the first forward
        assert first.logits is None and first.final is not None
    deferred = target.forward(ids[:, 25:], caches[0], defer_logits=True, hidden_layers=(0,))
    target.forward(ids[:, 20:25], caches[1])
    full = target.forward(ids[:, 25:], caches[1], hidden_layers=(0,))
    assert deferred.logits is None and deferred.final.shape == (1, 5, target.hidden_size)
    assert torch.equal(deferred.hidden, full.hidden)
    assert torch.allclose(target.head(deferred.final), full.logits, atol=1e-5)
    if packed:
        assert torch.equal(target.head(deferred.final), full.logits)
        assert torch.equal(target.head(deferred.final[:, [1, 3]]), full.logits[:, [1, 3]])


def test_a_soft_capping_head_never_defers():
    """Gemma-2-style final soft-capping: the logits are not the output embedding of the states; never defer."""
    target = make_target("gemma3", final_logit_softcapping=3.0)
    cache = KVCache()
    target.forward(torch.tensor([[5, 6, 7]]), cache, logits_to_keep=1)
    for t in (8, 9):
        out = target.forward(torch.tensor([[t]]), cache, defer_logits=True)
        assert out.logits is not None and out.final is None
