"""Fast verification paths equal their paper-notation references on the same random draws."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits
from byblock.verify.greedy import verify_greedy
from byblock.verify.reference import reference_greedy, reference_rejection, reference_tree_sampling
from byblock.verify.rejection import rejection_chain
from byblock.verify.tree_sampling import walk_sampled
from byblock.verify.types import Draft, Noise


def random_tree(n: int, vocab: int, g: torch.Generator, chain: bool) -> Draft:
    tokens = torch.randint(0, vocab, (n,), generator=g)
    if chain:
        return Draft.chain(tokens)
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    return Draft(tokens=tokens, parents=torch.tensor(parents, dtype=torch.long))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 16), st.integers(2, 6), st.booleans(), st.integers(0, 10**6))
def test_greedy_fast_equals_reference(n, vocab, chain, seed):
    g = torch.Generator().manual_seed(seed)
    draft = random_tree(n, vocab, g, chain)
    logits = torch.randn(n + 1, vocab, generator=g)
    assert verify_greedy(draft, logits) == reference_greedy(draft, logits)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 16), st.integers(2, 6), st.booleans(), st.integers(0, 10**6))
def test_tree_sampling_fast_equals_reference(n, vocab, chain, seed):
    g = torch.Generator().manual_seed(seed)
    draft = random_tree(n, vocab, g, chain)
    logits = torch.randn(n + 1, vocab, generator=g)
    params = SamplingParams(temperature=0.8, top_p=0.9) if seed % 2 else SamplingParams(temperature=1.0)
    noise = Noise.draw(n, vocab, g, "cpu")
    fast = walk_sampled(draft, logits, params, noise)
    assert fast == reference_tree_sampling(draft, process_logits(logits, params), noise)


def test_noise_rows_are_fresh_then_remembered():
    """A row's variates are the same whoever asks and however often; different rows and rounds differ."""
    g = torch.Generator().manual_seed(3)
    noise = Noise.draw(8, 50, g, "cpu")
    later_first = [noise.exp_row(r) for r in (5, 0, 5)]
    assert torch.equal(later_first[0], later_first[2])
    assert torch.equal(noise.exp_row(0), later_first[1])
    assert not torch.equal(noise.exp_row(0), noise.exp_row(5))
    assert not torch.equal(noise.exp_row(0), Noise.draw(8, 50, g, "cpu").exp_row(0))


def test_sampled_walk_draws_only_the_rows_on_its_path():
    """The point of lazy rows: a 31-node tree whose root sample matches no child costs one row of variates."""

    class CountingNoise(Noise):
        def exp_row(self, row: int) -> torch.Tensor:
            asked.append(row)
            return super().exp_row(row)

    asked: list[int] = []
    vocab = 40
    draft = Draft(tokens=torch.arange(1, 32), parents=torch.full((31,), -1))  # 31 children of the root
    logits = torch.full((32, vocab), -30.0)
    logits[:, 0] = 30.0  # the target always says token 0, which no child carries
    base = Noise.draw(31, vocab, torch.Generator().manual_seed(0), "cpu")
    verdict = walk_sampled(draft, logits, SamplingParams(temperature=1.0), CountingNoise(base.u, vocab, base.generator))
    assert verdict.tokens == [0] and asked == [0]


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.integers(2, 6), st.integers(0, 10**6), st.booleans())
def test_rejection_fast_equals_reference(k, vocab, seed, sparse):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(k + 1, vocab, generator=g).softmax(-1)
    q = torch.randn(k, vocab, generator=g).softmax(-1)
    if sparse:  # top-k style zeros in p and q
        p = p * (torch.rand(k + 1, vocab, generator=g) > 0.4)
        p[:, 0] += 1e-3
        p = p / p.sum(-1, keepdim=True)
        q = q * (torch.rand(k, vocab, generator=g) > 0.4)
        q[:, 1] += 1e-3
        q = q / q.sum(-1, keepdim=True)
    x = torch.multinomial(q, 1, generator=g).squeeze(-1)
    draft = Draft.chain(x, q=q)
    noise = Noise.draw(k, vocab, g, "cpu")
    assert rejection_chain(draft, p, noise) == reference_rejection(draft, p, noise)


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 5, generator=g).softmax(-1)
    p = torch.cat([q, torch.randn(1, 5, generator=g).softmax(-1)])
    for _ in range(50):
        x = torch.multinomial(q, 1, generator=g).squeeze(-1)
        verdict = rejection_chain(Draft.chain(x, q=q), p, Noise.draw(8, 5, g, "cpu"))
        assert verdict.num_accepted == 8


def test_tree_ancestor_mask_and_depths():
    draft = Draft(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, 0, -1, 2]))
    assert draft.depths().tolist() == [1, 2, 1, 2]
    m = draft.ancestor_mask().int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]
