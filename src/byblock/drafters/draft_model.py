"""A separate small causal LM as drafter (Leviathan et al. 2023): the classic speculative baseline.

The draft model keeps its own KV cache in step with the committed context: each round it crops back to
the longest prefix it shares with the context, feeds what it has not seen, then drafts γ tokens one by one.
"""

from __future__ import annotations

import torch

from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.sampling.draft_adjust import DraftAdjust
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import process_logits, sample
from byblock.verify.types import Draft, Verdict


def check_same_vocabulary(draft: TargetModel, target: TargetModel) -> None:
    """Refuse a draft model whose tokenizer maps tokens to different ids than the target's."""
    dv, tv = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dv != tv:
        diff = len(set(dv.items()) ^ set(tv.items()))
        raise ByblockError(
            f"draft model '{draft.name}' has a different vocabulary than target '{target.name}' "
            f"({len(dv)} vs {len(tv)} tokens, {diff} mismatched entries); use a draft with the same tokenizer"
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter:
    """Draft γ tokens autoregressively with a small model sharing the target's tokenizer."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, draft: TargetModel, target_vocab: int, block_size: int = 4) -> None:
        self.draft = draft
        self.name = f"model:{draft.name}"
        self.block_size = block_size
        self.target_vocab = target_vocab
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self.adjust: DraftAdjust | None = None  # the request's penalties / grammar, applied to the draft rows
        self.cache = draft.new_cache()
        self.cached: list[int] = []

    def start(
        self,
        prompt_ids: list[int],
        target_hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator | None,
        adjust: DraftAdjust | None = None,
    ) -> None:
        """Fresh cache per request."""
        self.params, self.generator, self.adjust = params, generator, adjust
        self.cache = self.draft.new_cache()
        self.cached = []

    def fork(self) -> ModelDrafter:
        """The same draft model, its own cache."""
        return ModelDrafter(self.draft, self.target_vocab, self.block_size)

    def _fit_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """Pad or cut draft probs [V_d] to the target vocabulary (padding ids are never real tokens)."""
        v = q.shape[-1]
        if v == self.target_vocab:
            return q
        if v > self.target_vocab:
            q = q[: self.target_vocab]
            return q / q.sum()
        return torch.nn.functional.pad(q, (0, self.target_vocab - v))

    def _fit_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [V_d] cut or padded (at -inf) to the target vocabulary."""
        v = logits.shape[-1]
        if v >= self.target_vocab:
            return logits[: self.target_vocab]
        return torch.nn.functional.pad(logits.float(), (0, self.target_vocab - v), value=float("-inf"))

    def propose(self, tokens: list[int], max_depth: int) -> Draft:
        """γ = min(block_size, max_depth) tokens; greedy or sampled with q recorded for rejection sampling."""
        gamma = min(self.block_size, max_depth, self.draft.max_context - len(tokens))
        if gamma < 1:
            return Draft.empty()
        keep = min(_common_prefix(self.cached, tokens), len(tokens) - 1)
        self.cache.crop(keep)
        feed = tokens[keep:]
        dev = self.draft.device
        logits = self.draft.forward(torch.tensor([feed], device=dev), self.cache, logits_to_keep=1).logits[0, -1]
        self.cached = list(tokens)
        xs: list[int] = []
        qs: list[torch.Tensor] = []
        for i in range(gamma):
            if self.adjust is not None:  # in the target's vocabulary, after the committed output and xs
                logits = self.adjust.row(self._fit_logits(logits), xs)
                if float(logits.max()) == float("-inf"):
                    break
            if self.params.greedy:
                x = int(logits[: self.target_vocab].argmax())
            else:
                q = self._fit_vocab(process_logits(logits, self.params))  # [V]
                x = int(sample(q, self.generator))
                qs.append(q)
            xs.append(x)
            if i + 1 < gamma:
                step = torch.tensor([[x]], device=dev)
                logits = self.draft.forward(step, self.cache, logits_to_keep=1).logits[0, -1]
                self.cached.append(x)
        return Draft.chain(xs, q=torch.stack(qs) if qs else None)

    def observe(self, verdict: Verdict, target_hidden: torch.Tensor | None) -> None:
        """Nothing: the next propose() crops the cache to the accepted prefix."""
