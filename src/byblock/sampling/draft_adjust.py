"""A request's logit adjustments (penalties, logit bias, grammar mask) applied to the drafter's rows as well.

Verification already adjusts every target row with its own path (verify/rows.py AdjustedRows), so speculative
decoding is lossless whatever the drafter proposes. What the drafter gains from seeing the same adjustments is
acceptance: a drafter that ignores a repetition penalty keeps proposing the repeats the target now avoids, and one
that ignores the grammar drafts tokens the mask refuses (a chain used to be cut there, a tree wasted the rows).

    row    one drafted position's logits after the committed output and the drafted `path` before it: the
           target's adjustment at that node, exactly (penalties count the path; the grammar consumes it)
    rows   a block of positions whose paths the drafter does not know yet (DDTree's per-depth marginals):
           the committed state's penalties on every row, the grammar mask on the first row only (deeper masks
           depend on the path)
    chain  a chain picked position by position from adjusted rows (argmax, or a draw whose q is recorded)

Under sampling the q a drafter records is the processed *adjusted* distribution it drew from, so rejection
sampling stays exact. Drafters with their own vocabulary pass `vocab` (draft id -> target id): the adjustment
is computed in the drafter's vocabulary, at the draft ids of the target ids it changes.

Cost: penalties change only the ids the prompt, the output and logit_bias hold (Penalties.touched), so a row is
adjusted at those few hundred columns, never over the whole vocabulary; a greedy chain under penalties that only
lower logits needs one argmax pass over the block (DraftAdjust._greedy_penalized).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from byblock.sampling.grammar import Constraint
from byblock.sampling.params import SamplingParams
from byblock.sampling.penalties import Penalties
from byblock.sampling.processors import process_logits, sample

NEG_INF = float("-inf")


class DraftAdjust:
    """The adjustments of one request, shared with its TokenSelector (same penalty counts, same matcher)."""

    def __init__(self, penalties: Penalties | None, grammar: Constraint | None, vocab_size: int) -> None:
        """penalties / grammar: the selector's (advanced as tokens commit); vocab_size: the target's."""
        self.penalties = penalties
        self.grammar = grammar
        self.vocab_size = vocab_size
        self._vocab_key: torch.Tensor | None = None  # the drafter vocabulary the two maps below were made for
        self._vocab_host: list[int] = []
        self._inverse = torch.empty(0, dtype=torch.long)  # target id -> draft id, −1 outside

    def _maps(self, vocab: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """`vocab` as a host list and its inverse, made once per drafter vocabulary (read every position)."""
        if self._vocab_key is not vocab:
            inv = torch.full((self.vocab_size,), -1, dtype=torch.long, device=vocab.device)
            inv[vocab] = torch.arange(len(vocab), device=vocab.device)
            self._vocab_key, self._vocab_host, self._inverse = vocab, vocab.tolist(), inv
        return self._vocab_host, self._inverse

    def _penalize(self, x: torch.Tensor, path: list[int], vocab: torch.Tensor | None) -> None:
        """Penalties on rows x [..., Vd] (this call's own tensor: in place) after the committed output + path."""
        pen = self.penalties
        assert pen is not None
        tids = pen.touched(path)  # sorted target ids
        cols = tids
        if vocab is not None:
            cols = self._maps(vocab)[1][tids]
            keep = cols >= 0
            tids, cols = tids[keep], cols[keep]
        # drafted tokens are all in the draft vocabulary, so among tids
        x[..., cols] = pen.at(x[..., cols], tids, pen.path_counts(tids, path))

    def _mask(self, x: torch.Tensor, path: list[int], vocab: torch.Tensor | None) -> torch.Tensor:
        assert self.grammar is not None
        allowed = self.grammar.allowed(path)
        return x.masked_fill(~(allowed if vocab is None else allowed[vocab]), NEG_INF)

    def row(self, logits: torch.Tensor, path: Sequence[int] = (), vocab: torch.Tensor | None = None) -> torch.Tensor:
        """logits [Vd] of the position after the committed output and `path` (target ids) -> float32 [Vd]."""
        x = logits.float().clone()
        if self.penalties is not None:
            self._penalize(x, list(path), vocab)
        return self._mask(x, list(path), vocab) if self.grammar is not None else x

    def rows(self, logits: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """logits [D, Vd] of depths 1..D with unknown paths -> float32 [D, Vd] (see the module docstring)."""
        x = logits.float().clone()
        if self.penalties is not None:
            self._penalize(x, [], vocab)  # every row at once: the committed counts broadcast over the block
        if self.grammar is not None and x.shape[0]:
            x[0] = self._mask(x[0], [], vocab)
        return x

    def chain(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        vocab: torch.Tensor | None = None,
    ) -> tuple[list[int], list[torch.Tensor]]:
        """A chain from logits [D, Vd], one position at a time: (draft-vocabulary ids, q rows [Vd] when sampling).

        It stops early where a position has no allowed token (the grammar refuses all of the draft vocabulary).
        Each position's row equals row(logits[d], path) value for value: the block is penalised once from the
        committed counts, then each row again at the path's few tokens."""
        host_vocab = self._maps(vocab)[0] if vocab is not None else None
        pen = self.penalties
        base = logits.float().clone()
        if pen is not None:
            self._penalize(base, [], vocab)  # the committed state on every row at once
            if self.grammar is None and params.greedy and pen.only_lowers:
                return self._greedy_penalized(logits, base, vocab), []
        ids: list[int] = []
        path: list[int] = []
        qs: list[torch.Tensor] = []
        for d in range(logits.shape[0]):
            x = base[d]
            if path and pen is not None:  # the path's tokens count once more each: recompute them from the raw row
                toks = torch.tensor(sorted(set(path)), dtype=torch.long, device=x.device)
                x[self._cols(toks, vocab)] = self._at(logits[d], toks, path, vocab)
            if self.grammar is not None and params.greedy:
                # The row's best token, when the grammar takes it, is the masked row's best: one token checked
                # instead of a mask over the vocabulary (~0.15 ms each); the mask only where it is refused.
                t = int(x.argmax())
                tid = host_vocab[t] if host_vocab is not None else t
                if self.grammar.accepts([*path, tid]):
                    ids.append(t)
                    path.append(tid)
                    continue
            if self.grammar is not None:
                x = self._mask(x, path, vocab)
            best, arg = x.max(-1)
            if float(best) == NEG_INF:
                break
            if params.greedy:
                t = int(arg)
            else:
                q = process_logits(x, params)
                t = int(sample(q, generator))
                qs.append(q)
            ids.append(t)
            path.append(host_vocab[t] if host_vocab is not None else t)
            if self.grammar is not None and path[-1] in self.grammar.eos:
                break  # the grammar ended the output: nothing after it can be emitted
        return ids, qs

    def _cols(self, toks: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        return toks if vocab is None else self._maps(vocab)[1][toks]

    def _at(self, raw: torch.Tensor, toks: torch.Tensor, path: list[int], vocab: torch.Tensor | None) -> torch.Tensor:
        """Penalised values at target ids `toks` (sorted, all on `path`) of one raw row [Vd]."""
        assert self.penalties is not None
        return self.penalties.at(raw.float()[self._cols(toks, vocab)], toks, self.penalties.path_counts(toks, path))

    def _greedy_penalized(self, logits: torch.Tensor, base: torch.Tensor, vocab: torch.Tensor | None) -> list[int]:
        """chain() when greedy under penalties that only lower logits (repetition >= 1, presence and frequency
        >= 0) and no grammar, in a few passes over the block instead of one per position (each costs ~80 µs at a
        49K vocabulary on 2 threads). base: the block penalised from the committed counts.

        One more occurrence only lowers a token, so walking a row's committed-state ranking, the first token off
        the path is the best off it, and only path tokens ranked above it can still win, with their values
        recomputed for their count on the path. A row's top D+1 always holds such a token (the path has < D),
        and the recomputed values for every candidate and count 1..D come from one vectorised call."""
        assert self.penalties is not None
        depth = base.shape[0]
        top_v, top_i = base.topk(min(depth + 1, base.shape[1]), dim=-1)  # [D, k] draft ids
        cand = top_i.unique()  # [U] draft ids
        tids = cand if vocab is None else vocab[cand]
        counts = torch.arange(1, depth + 1, dtype=torch.float32, device=base.device)
        raw = logits.float()[:, cand, None]  # [D, U, 1]
        # corrected[d, u, c - 1]: candidate u's value in row d when the path holds it c times
        corrected = self.penalties.at(raw, tids[None, :, None], counts[None, None, :])
        corrected = corrected.expand(depth, len(cand), depth).cpu().numpy()
        column = {t: j for j, t in enumerate(cand.tolist())}
        ranked_v, ranked_i = top_v.tolist(), top_i.tolist()
        ids: list[int] = []  # draft-vocabulary ids
        on_path: dict[int, int] = {}  # draft id -> occurrences so far
        for d in range(depth):
            best_v, best_t = NEG_INF, -1
            for v, t in zip(ranked_v[d], ranked_i[d], strict=True):
                if t in on_path:
                    v = float(corrected[d, column[t], on_path[t] - 1])
                if v > best_v or (v == best_v and t < best_t):  # argmax's tie order: the lowest id
                    best_v, best_t = v, t
                if t not in on_path:
                    break
            ids.append(best_t)
            on_path[best_t] = on_path.get(best_t, 0) + 1
        return ids
