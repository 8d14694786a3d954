"""Turn raw logits into the distribution tokens are drawn from (temperature, min-p, top-k, top-p).

Target and drafter go through this one function, so p and q are always processed identically.
"""

from __future__ import annotations

import math

import torch

from byblock.sampling.params import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return probabilities after temperature, top-k and top-p filtering.

    logits: [..., V] (any float dtype). Returns float32 probs [..., V] that sum to 1 on the last dim.
    Greedy params give a one-hot distribution at the argmax (what a deterministic decoder samples from).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # Shift by the max first: with a tiny temperature (1e-30) x / T overflows to ±inf and inf - inf is NaN;
    # shifted, the top logit stays 0 and the rest go to -inf, the exact T -> 0 limit. T is floored at float32's
    # smallest normal (a subnormal T would round to 0 in the division); the result is one-hot either way.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if params.min_p > 0.0:
        # p(x) < min_p * p_max  <=>  logit(x) < log(min_p) + max logit, and the max logit is 0 after the shift.
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest normal rounds to 0 in the comparison
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def first_max(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum over the last dim, the first one on ties: `x.argmax(-1)` exactly (both are
    documented to return the first maximal index), but torch's CPU max-reduction takes ~26 µs for a 49K
    vocabulary row where argmax takes ~72 (every greedy step and verify reads rows of that size)."""
    return x.max(-1).indices


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of probs [..., V] -> [...] int64.

    Uses the exponential race argmax(p / e), e ~ Exp(1): an exact draw from p (the Gumbel-max trick) that
    verification also uses, so plain and speculative sampling share one primitive.
    """
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return first_max(probs / e)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row of logits [V]: argmax when greedy, else a draw from processed probs."""
    if params.greedy:
        return int(first_max(logits))
    return int(sample(process_logits(logits, params), generator))


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` (the model's: draws happen there) seeded from `seed`, or fresh entropy when None.

    The same seed on another device type draws other samples: reproducibility holds per device."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
