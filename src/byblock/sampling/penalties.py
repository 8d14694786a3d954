"""History-dependent adjustments of a row's raw logits: repetition, presence and frequency penalties, logit bias.

Definitions are vLLM's (and so the OpenAI API's as vLLM serves it):
    seen(x)   = x occurs in the prompt or the output so far          (repetition penalty)
    count(x)  = occurrences of x in the output so far                (presence / frequency)
    logit'(x) = logit(x) / r  if seen(x) and logit(x) > 0;   logit(x) * r  if seen(x) and logit(x) <= 0
    logit'(x) -= frequency * count(x) + presence * [count(x) > 0];   logit'(x) += bias(x)

A row's "output so far" depends on the row: in a verify forward, the row of drafted node i continues the
committed output with the drafted tokens on the path from the root to i. `Penalties.row(logits, extra)`
takes those path tokens (verify/rows.py AdjustedRows finds them), so each row is adjusted exactly as plain
decoding would adjust it at that position.
"""

from __future__ import annotations

import torch

from byblock.errors import InvalidParameterError
from byblock.sampling.params import SamplingParams


class Penalties:
    """One request's penalty state: which tokens the prompt holds and how often each output token occurred."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab: int, device: torch.device) -> None:
        """vocab: the target's vocabulary size; device: the target's (the adjusted logits live there)."""
        for t in (*(i for i, _ in params.logit_bias), *params.stop_token_ids):
            if t >= vocab:
                raise InvalidParameterError(f"token id {t} is outside the vocabulary (size {vocab})")
        self.params = params
        self.device = device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # output occurrences
        self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        if prompt_ids:
            self.prompt_seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.bias = torch.zeros(vocab, dtype=torch.float32, device=device)
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, dtype=torch.float32, device=device)

    def append(self, tokens: list[int]) -> None:
        """Tokens committed to the output."""
        if tokens:
            idx = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.counts.index_add_(0, idx, torch.ones(len(tokens), device=self.device))

    def row(self, logits: torch.Tensor, extra: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """logits [V] of a row whose output continues the committed one with `extra` -> adjusted float32 [V]."""
        p = self.params
        counts = self.counts
        if extra:
            idx = torch.tensor(extra, dtype=torch.long, device=self.device)
            counts = counts.index_add(0, idx, torch.ones(len(extra), device=self.device))
        x = logits.float()
        if p.repetition_penalty != 1.0:
            seen = self.prompt_seen | (counts > 0)
            r = p.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        if p.presence_penalty:
            x = x - p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            x = x + self.bias
        return x
