"""The Drafter contract: propose candidate tokens from the committed context; be told what was accepted."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from byblock.sampling.draft_adjust import DraftAdjust
from byblock.sampling.params import SamplingParams
from byblock.verify.types import Draft, Verdict


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes drafts for the engine's draft → verify → commit loop.

    Lifecycle per request: start() once, then propose() / observe() once per round.
    """

    name: str
    block_size: int  # the deepest draft it proposes
    hidden_layers: tuple[int, ...]  # target layers whose hidden states it conditions on (empty: none)

    def start(
        self,
        prompt_ids: list[int],
        target_hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        adjust: DraftAdjust | None = None,
    ) -> None:
        """Reset per-request state. target_hidden: [1, T, k*H] for the prompt when hidden_layers is set;
        adjust: the request's penalties / grammar mask, for drafters that score tokens (sampling/draft_adjust.py)."""
        ...

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """Candidates to follow `tokens` (the committed context, its last token not yet verified-cached).

        Never deeper than max_depth (>= 1). Node tokens must be target vocabulary ids; a drafter that
        samples sets Draft.q to the processed (same SamplingParams) distribution it sampled from.
        """
        ...

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """The round's outcome. target_hidden: [1, 1+a, k*H] for the root and the a accepted nodes."""
        ...

    def fork(self) -> Drafter:
        """A drafter for another request decoded at the same time (the batched engine): the same weights and
        settings, its own per-request state. Stateless drafters may return themselves."""
        ...


class StatelessDrafter:
    """Base for drafters that need no per-request bookkeeping beyond the context they are handed."""

    name = "base"
    block_size = 1
    hidden_layers: tuple[int, ...] = ()

    def start(
        self,
        prompt_ids: list[int],
        target_hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        adjust: DraftAdjust | None = None,
    ) -> None:
        """Nothing to reset."""

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Nothing to learn from the outcome."""

    def fork(self) -> StatelessDrafter:
        """No per-request state: one instance serves every request."""
        return self


class UnadjustedDrafter:
    """A drafter never handed the request's adjustments (sampling/draft_adjust.py): it drafts from its raw rows,
    as drafters did before they saw penalties and grammar masks — the A/B baseline of benchmarks/
    sampling_surface.py and tests/test_draft_adjust.py. Everything else is the wrapped drafter's."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def start(self, prompt_ids, target_hidden, params, generator, adjust=None) -> None:
        """The wrapped drafter's start, without `adjust`."""
        self.inner.start(prompt_ids, target_hidden, params, generator)

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """The wrapped drafter's draft."""
        return self.inner.propose(tokens, max_depth)

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """The wrapped drafter's bookkeeping."""
        self.inner.observe(verdict, target_hidden)

    def fork(self) -> UnadjustedDrafter:
        """A fork of the wrapped drafter, still unadjusted."""
        return UnadjustedDrafter(self.inner.fork())
