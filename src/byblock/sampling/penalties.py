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
        # The only ids any adjustment changes: the prompt's (repetition), the output's, the biased ones. A row is
        # adjusted at these alone (a few hundred of a 49K vocabulary), the rest is left as it is — the same
        # values as the dense formula, whose terms are all zero there.
        self._touched = {*(prompt_ids if params.repetition_penalty != 1.0 else ()), *(i for i, _ in params.logit_bias)}
        self._touched_ids: torch.Tensor | None = None

    def append(self, tokens: list[int]) -> None:
        """Tokens committed to the output."""
        if tokens:
            idx = torch.tensor(tokens, dtype=torch.long, device=self.device)
            self.counts.index_add_(0, idx, torch.ones(len(tokens), device=self.device))
            if not self._touched.issuperset(tokens):
                self._touched.update(tokens)
                self._touched_ids = None

    @property
    def only_lowers(self) -> bool:
        """Whether one more occurrence of a token can only lower its logit (repetition >= 1, presence and
        frequency >= 0)."""
        p = self.params
        return p.repetition_penalty >= 1.0 and p.presence_penalty >= 0.0 and p.frequency_penalty >= 0.0

    def touched(self, extra: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """[k] int64: the ids an adjustment may change, `extra` (path tokens) included."""
        if self._touched_ids is None:
            self._touched_ids = torch.tensor(sorted(self._touched), dtype=torch.long, device=self.device)
        if extra and not self._touched.issuperset(extra):
            return torch.tensor(sorted(self._touched.union(extra)), dtype=torch.long, device=self.device)
        return self._touched_ids

    def row(self, logits: torch.Tensor, extra: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
        """logits [..., V] of rows whose output continues the committed one with `extra` -> adjusted float32."""
        ids = self.touched(extra)
        x = logits.float().clone()
        x[..., ids] = self.at(x[..., ids], ids, self.path_counts(ids, extra))
        return x

    def path_counts(self, ids: torch.Tensor, path: list[int]) -> torch.Tensor:
        """[k] float32: how often each of the sorted `ids` occurs on `path` (every path token among them)."""
        counts = torch.zeros(len(ids), device=self.device)
        if path:
            pos = torch.searchsorted(ids, torch.tensor(path, dtype=torch.long, device=self.device))
            counts.index_add_(0, pos, torch.ones(len(path), device=self.device))
        return counts

    def at(self, logits: torch.Tensor, ids: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        """The adjusted values at token `ids` [k] only, given their raw logits [k] and `extra` [k] occurrences on
        top of the committed counts: equal, value for value, to row()'s at those ids (the same operations)."""
        return self._apply(logits.float(), self.counts[ids] + extra, self.prompt_seen[ids], self.bias[ids])

    def _apply(self, x: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor, bias: torch.Tensor):
        p = self.params
        if p.repetition_penalty != 1.0:
            seen = prompt_seen | (counts > 0)
            r = p.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * counts
        if p.presence_penalty:
            x = x - p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            x = x + bias
        return x
