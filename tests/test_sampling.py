"""Sampling parameters, logits processing and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from byblock import SamplingParams, generate
from byblock.errors import InvalidParameterError
from byblock.sampling.processors import process_logits, sample


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_new_tokens": 0},
        {"seed": -3},
        {"stop": ("",)},
    ],
)
def test_invalid_params_rejected(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_filter():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)
    # top_p just above the first token's mass keeps exactly two tokens
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p > 0).sum() == 2
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) * 0.5))
    assert (p > 0).sum() == 1


def test_exponential_race_sampling_matches_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.2])
    draws = sample(probs.expand(20000, 3), g)
    freq = torch.bincount(draws, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_seeded_sampling_reproducible_and_seeds_differ(tiny_targets):
    target = tiny_targets["llama"]
    ids = target.encode_prompt("The quick brown fox", chat=False)

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=30, temperature=1.5, seed=seed, ignore_eos=True)
        return generate(target, ids, params).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_extreme_temperature_and_top_p_stay_valid_distributions():
    """Found by the server fuzz: T = 5e-324 made NaNs (x / T overflow) and top_p = 1e-300 dropped every token."""
    logits = torch.randn(2, 320) * 10
    for params in (SamplingParams(temperature=5e-324), SamplingParams(temperature=1.0, top_p=1e-300)):
        probs = process_logits(logits, params)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.allclose(probs.max(-1).values, torch.ones(2))


def test_first_max_is_argmax_ties_included():
    """first_max (the max-reduction's index) is argmax bit for bit: random rows, ties (the first one wins), -inf
    rows from grammar masks, a single column."""
    from byblock.sampling.processors import first_max

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g)
    ties = torch.randint(0, 3, (64, 1000), generator=g).float()  # many equal maxima per row
    masked = torch.full((4, 50), float("-inf"))
    masked[:, 7] = 0.0
    for t in (x, ties, masked, torch.full((3, 9), float("-inf")), x[:, :1], x[0]):
        assert torch.equal(first_max(t), t.argmax(-1))
