"""The shared losslessness harness. Every drafter byblock ships must pass it.

- greedy_outputs_match: speculative output is token-identical to plain decoding (and stops identically).
- sampling_pvalue: speculative sampling's first tokens vs the exactly enumerated target law (chi-square).
- NoisyOracleDrafter: a test drafter that proposes random trees mixing the true continuation with
  corruption, so acceptance lengths and tree shapes of every kind are exercised.
"""

from __future__ import annotations

import torch
from stats import chi_square_pvalue

from byblock import SamplingParams, generate
from byblock.drafters.base import StatelessDrafter
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.types import SpecStats
from byblock.sampling.processors import process_logits
from byblock.verify.types import Draft


class NoisyOracleDrafter(StatelessDrafter):
    """Proposes trees whose main branch follows a known reference continuation, corrupted at random."""

    name = "noisy-oracle"

    def __init__(self, reference: list[int], block_size: int, tree: bool, vocab: int, seed: int) -> None:
        self.reference = reference  # prompt + plain-decoded continuation
        self.block_size = block_size
        self.tree = tree
        self.vocab = vocab
        self.g = torch.Generator().manual_seed(seed)

    def _rand(self, hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=self.g))

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        depth = min(self.block_size, max_depth)
        n = len(tokens)
        truth = self.reference[n : n + depth] if self.reference[:n] == tokens else []
        main = list(truth) + [self._rand(self.vocab) for _ in range(depth - len(truth))]
        if main and self._rand(2):  # corrupt one position
            main[self._rand(len(main))] = self._rand(self.vocab)
        if not self.tree:
            return Draft.chain(main)
        toks, parents = list(main), list(range(-1, len(main) - 1))
        for _ in range(self._rand(self.block_size + 1)):  # random side branches
            toks.append(self._rand(self.vocab))
            parents.append(self._rand(len(toks)) - 1)  # any earlier node, or the root
            if self._rand(3) == 0 and main:  # sometimes a branch carries the truth token at its depth
                toks[-1] = main[0] if parents[-1] == -1 else toks[-1]
        return Draft(tokens=torch.tensor(toks, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long))


def greedy_outputs_match(target, prompt_ids: list[int], params: SamplingParams, drafter) -> tuple:
    """Run plain and speculative decoding; return (plain result, speculative result) after asserting equality."""
    plain = generate(target, prompt_ids, params)
    spec = generate(target, prompt_ids, params, drafter=drafter)
    assert spec.token_ids == plain.token_ids, (spec.token_ids, plain.token_ids)
    assert spec.text == plain.text
    assert spec.finish_reason == plain.finish_reason
    return plain, spec


SAMPLING_ALPHA = 1e-3


def exact_joint(target, prompt: list[int], params: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """The exact law of the first `length` tokens plain sampling draws (enumerated; needs top-k to stay small)."""
    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            exact[tuple(prefix)] = prob
            return
        logits = target.forward(torch.tensor([prompt + prefix]), target.new_cache()).logits[0, -1]
        p = process_logits(logits, params)
        for t in torch.nonzero(p).flatten().tolist():
            expand([*prefix, t], prob * float(p[t]))

    expand([], 1.0)
    return exact


def sampling_pvalue(target, drafter, prompt: list[int], params: SamplingParams, length: int = 4, trials: int = 1500):
    """Chi-square p-value of the first `length` tokens of speculative sampling vs the exact target law."""
    exact = exact_joint(target, prompt, params, length)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(trials):
        loop = speculative_decode(target, drafter, prompt, params, g, SpecStats())
        samples.append(tuple(next(loop).token_id for _ in range(length)))
        loop.close()
    return chi_square_pvalue(samples, exact)
