"""One request's token choice: target rows in, emitted TokenEvents out (penalties, sampling, logprobs).

Every decoding loop — plain, speculative, and the batched engine's rounds — chooses tokens through this one
object, so a request makes the same choices whichever loop runs it:

    first / step   one row  -> adjust (penalties, logit bias) -> argmax or draw -> TokenEvent (+ logprob)
    verify         N+1 rows -> adjust each row with its own path -> verify(draft) -> a + 1 TokenEvents
"""

from __future__ import annotations

import torch

from byblock.engine.types import TokenEvent
from byblock.sampling.logprobs import token_logprob
from byblock.sampling.params import SamplingParams
from byblock.sampling.penalties import PenalizedRows, Penalties
from byblock.sampling.processors import choose
from byblock.verify import Draft, TargetRows, Verdict, verify


class TokenSelector:
    """Per request (see the module docstring); `penalties` is None when no row is ever adjusted."""

    def __init__(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        prompt_ids: list[int],
        vocab: int,
        device: torch.device,
    ) -> None:
        """vocab / device: the target's."""
        self.params = params
        self.generator = generator
        self.penalties = Penalties(params, prompt_ids, vocab, device) if params.adjusts_logits else None
        if self.penalties is None and params.stop_token_ids:
            Penalties(params, [], vocab, device)  # validates the ids against the vocabulary
        self.k = params.logprobs

    def choose(self, logits: torch.Tensor) -> TokenEvent:
        """The next token from one raw row [V] (a prompt's last row, a plain step)."""
        row = logits if self.penalties is None else self.penalties.row(logits)
        token = choose(row, self.params, self.generator)
        if self.penalties is not None:
            self.penalties.append([token])
        lp = token_logprob(logits, token, self.k) if self.k is not None else None
        return TokenEvent(token, from_draft=False, logprob=lp)

    def verify(self, draft: Draft, rows: torch.Tensor | TargetRows) -> tuple[Verdict, list[TokenEvent]]:
        """Verify `draft` against the raw target rows [N+1, V]; the verdict and the tokens it emits."""
        adjusted = rows
        if self.penalties is not None:
            adjusted = PenalizedRows(rows, self.penalties, draft.tokens.tolist(), draft.parents.tolist())
        verdict = verify(draft, adjusted, self.params, self.generator)
        if self.penalties is not None:
            self.penalties.append(verdict.tokens)
        a = verdict.num_accepted
        if self.k is None:
            return verdict, [TokenEvent(t, from_draft=j < a) for j, t in enumerate(verdict.tokens)]
        parent_rows = [0, *(i + 1 for i in verdict.path)]  # token j was scored by its parent's row
        return verdict, [
            TokenEvent(t, from_draft=j < a, logprob=token_logprob(rows[r], t, self.k))
            for j, (t, r) in enumerate(zip(verdict.tokens, parent_rows, strict=True))
        ]
