"""The target features a feature-conditioned drafter (DFlash, EAGLE-3) has been given but not yet run."""

from __future__ import annotations

import torch


class PendingFeatures:
    """Target features [C, k*H] of committed positions start .. start + C − 1 not yet in a drafter's cache.

    Each round's features are queued as a part and joined only when a forward consumes them: a drafter that rests
    for many rounds (adaptive, batched) queues one part a round, and re-joining the whole queue every round was
    quadratic in the rest's length (dev/LOG.md, session 40)."""

    def __init__(self, first: torch.Tensor, start: int = 0) -> None:
        """first: [C, k*H], the prompt's features (positions start ..)."""
        self._parts = [first]
        self.start = start

    def append(self, features: torch.Tensor) -> None:
        """Queue the next positions' features [n, k*H]."""
        self._parts.append(features)

    def joined(self) -> torch.Tensor:
        """Every queued feature in order, [C, k*H] (one tensor; joined once, then kept joined)."""
        if len(self._parts) > 1:
            self._parts = [torch.cat(self._parts)]
        return self._parts[0]

    def consumed(self, end: int) -> None:
        """The queue went into the drafter's cache; the next features start at `end`."""
        self._parts = [self._parts[0][:0]]  # empty, of the features' width
        self.start = end
