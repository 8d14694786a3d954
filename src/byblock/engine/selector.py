"""One request's token choice: target rows in, emitted TokenEvents out (penalties, grammar, sampling, logprobs).

Every decoding loop — plain, speculative, and the batched engine's rounds — chooses tokens through this one
object, so a request makes the same choices whichever loop runs it:

    choose   one row  -> adjust (penalties, logit bias, grammar mask) -> argmax or draw -> TokenEvent (+ logprob)
    adjust   the same adjustments for the drafter's own rows (draft_adjust, handed to Drafter.start)
    trim     a drafted chain -> cut at the first token the grammar refuses (it could never be accepted)
    verify   N+1 rows -> adjust each row with its own path -> verify(draft) -> a + 1 TokenEvents
             (with a SpecGuardConfig, then the step check may keep more of a chain: NOT lossless,
             verify/specguard.py)
"""

from __future__ import annotations

import torch

from byblock.engine.types import TokenEvent
from byblock.sampling.draft_adjust import DraftAdjust
from byblock.sampling.grammar import Constraint
from byblock.sampling.logprobs import token_logprob
from byblock.sampling.params import SamplingParams
from byblock.sampling.penalties import Penalties
from byblock.sampling.processors import choose
from byblock.verify import Draft, TargetRows, Verdict, verify
from byblock.verify.rows import AdjustedRows
from byblock.verify.specguard import SpecGuardConfig, delimiter_ids, guarded_length, guarded_verdict


class TokenSelector:
    """Per request (see the module docstring). With neither penalties nor a grammar, rows pass untouched."""

    def __init__(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        prompt_ids: list[int],
        target,
        guard: SpecGuardConfig | None = None,
    ) -> None:
        """target: the TargetModel (its vocabulary, device, tokenizer and EOS ids); guard: SpecGuard's
        step-level acceptance (lossy, opt-in)."""
        self.params = params
        self.generator = generator
        vocab, dev = target.vocab_size, target.device
        self.penalties = Penalties(params, prompt_ids, vocab, dev) if params.adjusts_logits else None
        if self.penalties is None and params.stop_token_ids:
            Penalties(params, [], vocab, dev)  # validates the ids against the vocabulary
        self.grammar = None
        if params.grammar is not None:
            self.grammar = Constraint(params.grammar, target.tokenizer, vocab, tuple(target.eos_token_ids), dev)
        self.adjusted = self.penalties is not None or self.grammar is not None
        # The same adjustments for the drafter's rows (acceptance only: verification is lossless without them).
        self.draft_adjust = DraftAdjust(self.penalties, self.grammar, vocab) if self.adjusted else None
        self.k = params.logprobs
        self.guard = guard
        self.guard_ends = delimiter_ids(target.tokenizer, guard) if guard is not None else frozenset()
        self.guard_tokens = 0  # drafted tokens kept by the step check beyond what lossless verification kept

    def _adjust(self, logits: torch.Tensor, path: list[int]) -> torch.Tensor:
        if self.penalties is not None:
            logits = self.penalties.row(logits, path)
        if self.grammar is not None:
            logits = self.grammar.row(logits, path)
        return logits

    def _commit(self, tokens: list[int]) -> None:
        if self.penalties is not None:
            self.penalties.append(tokens)
        if self.grammar is not None:
            self.grammar.commit(tokens)

    def choose(self, logits: torch.Tensor) -> TokenEvent:
        """The next token from one raw row [V] (a prompt's last row, a plain step)."""
        token = choose(self._adjust(logits, []) if self.adjusted else logits, self.params, self.generator)
        self._commit([token])
        lp = token_logprob(logits, token, self.k) if self.k is not None else None
        return TokenEvent(token, from_draft=False, logprob=lp)

    def trim(self, draft: Draft) -> Draft:
        """`draft` without the chain tokens the grammar refuses (trees pass whole: their rows are masked)."""
        if self.grammar is None or not draft.is_chain or not draft.num_nodes:
            return draft
        n = self.grammar.valid_prefix(draft.tokens.tolist())
        if n == draft.num_nodes:
            return draft
        return Draft(tokens=draft.tokens[:n], parents=draft.parents[:n], q=None if draft.q is None else draft.q[:n])

    def verify(self, draft: Draft, rows: torch.Tensor | TargetRows) -> tuple[Verdict, list[TokenEvent]]:
        """Verify `draft` against the raw target rows [N+1, V]; the verdict and the tokens it emits."""
        adjusted = rows
        if self.adjusted:
            adjusted = AdjustedRows(rows, self._adjust, draft.tokens.tolist(), draft.parents.tolist())
        verdict = verify(draft, adjusted, self.params, self.generator)
        if self.guard is not None and draft.is_chain and draft.num_nodes > verdict.num_accepted:
            a = verdict.num_accepted
            keep = guarded_length(draft, adjusted, a, self.guard_ends, self.guard)
            if keep > a:
                bonus = choose(adjusted[keep], self.params, self.generator)  # the row after the kept step
                verdict = guarded_verdict(draft, keep, bonus)
                self.guard_tokens += keep - a
        self._commit(verdict.tokens)
        a = verdict.num_accepted
        if self.k is None:
            return verdict, [TokenEvent(t, from_draft=j < a) for j, t in enumerate(verdict.tokens)]
        parent_rows = [0, *(i + 1 for i in verdict.path)]  # token j was scored by its parent's row
        return verdict, [
            TokenEvent(t, from_draft=j < a, logprob=token_logprob(rows[r], t, self.k))
            for j, (t, r) in enumerate(zip(verdict.tokens, parent_rows, strict=True))
        ]
