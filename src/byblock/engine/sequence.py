"""One request inside the batched engine: its cache, drafter, generator and stopping state, and its rounds.

A round is what one request contributes to one packed forward and what it does with the result; the order
of operations is the single-request loops' (engine/plain.py, engine/spec_loop.py), so a request computes in a
batch exactly what it computes alone:

    plan    prefill: the prompt, or its next chunk      -> rows: the last one (its logits pick the first token)
            decode:  [root, x_1 .. x_N] from propose()  -> rows: the ones verification reads first (CPU), or all
    finish  prefill: (last chunk) choose the first token, start the drafter on the prompt's hidden states
            decode:  verify → commit the accepted slots → observe → the accepted tokens + one target token
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from byblock.drafters.base import Drafter
from byblock.engine.output import OutputProcessor
from byblock.engine.selector import TokenSelector
from byblock.engine.types import SpecStats
from byblock.kv.kv_cache import KVCache
from byblock.models.adapter import PackedOutput, SegmentInput, TargetModel
from byblock.sampling.params import SamplingParams
from byblock.sampling.processors import make_generator
from byblock.verify import Draft, TargetRows
from byblock.verify.rows import FIRST_ROWS


def own_layers(hidden: torch.Tensor, layers: tuple[int, ...], mine: tuple[int, ...]) -> torch.Tensor:
    """The columns of a drafter's own layers, in its order, from hidden states [..., len(layers) * H] that hold
    `layers` side by side (a packed forward serves drafters with different feature layers at once)."""
    h = hidden.shape[-1] // len(layers)
    return torch.cat([hidden[..., layers.index(i) * h : (layers.index(i) + 1) * h] for i in mine], dim=-1)


class Phase(Enum):
    """Where a request is."""

    WAITING = "waiting"  # queued, or preempted: no cache
    PREFILLING = "prefilling"  # a cache holding the first chunks of its prompt (chunked prefill)
    RUNNING = "running"  # prefilled: a cache and a root token
    FINISHED = "finished"


@dataclass(frozen=True)
class Round:
    """One request's part of a packed forward."""

    segment: SegmentInput
    rows: int  # logits rows it needs from the forward's head pass (its first rows)
    past: int  # cache slots before the forward
    draft: Draft | None  # None: a prefill or a plain step
    prefill: bool
    draft_s: float = 0.0
    prefill_done: bool = True  # a prefill round's segment ends the prompt (False: more chunks follow)


def round_rows(drafter: Drafter | None) -> int:
    """The most rows one round of this drafter puts in a forward (root + deepest chain or largest tree)."""
    if drafter is None:
        return 1
    nodes = [drafter.block_size] + [int(getattr(drafter, k, 0) or 0) for k in ("budget", "max_budget", "tree_budget")]
    return 1 + max(nodes)


class Sequence:
    """A request's decoding state (see the module docstring)."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        model: TargetModel,
        drafter: Drafter | None,
        arrival: float,
    ) -> None:
        """drafter: this request's own (a fork of the engine's, see Drafter.fork), or None for plain decoding."""
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.model = model
        self.drafter = drafter
        # Optional drafter capabilities, looked up once: the batched drafter forward and batch-aware sizing.
        self._ask_block = getattr(drafter, "block_request", None)
        self.set_batch_load = getattr(drafter, "set_batch_load", None)
        self.observe_host = getattr(drafter, "observe_host", None)  # adaptive drafters: seconds finishing a round
        self.max_rows = round_rows(drafter)  # the most rows one round adds to a forward (the KV slack)
        self.phase = Phase.WAITING
        self.tokens: list[int] = []  # committed: prompt + generated (the last one is the root, not yet cached)
        self.cache: KVCache | None = None
        self.prefilled = 0  # slots of the prefill source already in the cache (chunked prefill)
        self._prefill_hidden: list[torch.Tensor] = []  # the earlier chunks' hidden states, for the drafter
        self.generator = make_generator(params.seed, model.device)
        self.select = TokenSelector(params, self.generator, prompt_ids, model)
        self.stats = SpecStats()
        self.output = OutputProcessor(model, prompt_ids, params, arrival)
        self.last_rows, self.last_emitted = 1, 1  # of its last decode round (the batch load other requests see)

    @property
    def generated(self) -> int:
        """Tokens produced so far."""
        return max(0, len(self.tokens) - len(self.prompt_ids))

    @property
    def kv_tokens(self) -> int:
        """Slots this request holds (or will hold once prefilled)."""
        return max(len(self.tokens), len(self.prompt_ids))

    @property
    def prefill_source(self) -> list[int]:
        """What a prefill writes into the cache: the prompt, or after a preemption every committed token but
        the root."""
        return self.tokens[:-1] if self.tokens else self.prompt_ids

    @property
    def prefill_left(self) -> int:
        """Prefill rows still to run (0 once decoding)."""
        return 0 if self.phase is Phase.RUNNING else len(self.prefill_source) - self.prefilled

    def preempt(self) -> None:
        """Drop the cache; the next prefill recomputes every committed token but the root."""
        self.cache = None
        self.phase = Phase.WAITING
        self.prefilled, self._prefill_hidden = 0, []

    def plan_prefill(self, rows: int) -> Round:
        """The next `rows` tokens of the prefill source (all that is left, or a chunk aligned to the attention
        tiles, see kernels/gqa_sdpa.py) as this step's segment."""
        if self.phase is Phase.WAITING:
            self.cache = self.model.new_cache()
            self.phase = Phase.PREFILLING
        assert self.cache is not None
        source = self.prefill_source
        ids = source[self.prefilled : self.prefilled + rows]
        done = self.prefilled + len(ids) == len(source)
        logits = 1 if done and not self.tokens else 0  # a recomputed request's root is already chosen
        segment = SegmentInput(self.cache, ids, prompt=True)
        return Round(segment, rows=logits, past=self.prefilled, draft=None, prefill=True, prefill_done=done)

    def depth_budget(self) -> int:
        """The deepest draft this round may verify: never past what can still be emitted (the round adds one
        token of its own) or the context."""
        return min(self.params.max_new_tokens - self.generated, self.model.max_context - len(self.tokens)) - 1

    def block_request(self):
        """The DFlash backbone forward this round's propose() will run, as (drafter fork, anchor, anchor
        position, depth, block rows or None), for a batched drafter forward (drafters/dflash.py draft_blocks);
        None if none."""
        budget = self.depth_budget()
        if self._ask_block is None or budget <= 0:
            return None
        req = self._ask_block(self.tokens, budget)
        return None if req is None else (req[0], self.tokens[-1], len(self.tokens) - 1, req[1], req[2])

    def plan(self, lazy_head: bool, clock, drafted_s: float = 0.0) -> Round:
        """This step's segment: the prompt (or, after a preemption, the committed tokens) or a verify block.
        drafted_s: this request's share of a batched drafter forward that already ran for this round."""
        if self.phase is not Phase.RUNNING:
            return self.plan_prefill(self.prefill_left)
        assert self.cache is not None
        root = self.tokens[-1]
        if self.drafter is None:
            return Round(SegmentInput(self.cache, [root]), rows=1, past=self.cache.length, draft=None, prefill=False)
        budget = self.depth_budget()
        t0 = clock()
        draft = self.select.trim(self.drafter.propose(self.tokens, budget)) if budget > 0 else Draft.empty()
        draft_s = clock() - t0 + drafted_s
        past = self.cache.length
        positions = tree_mask = None
        if not draft.is_chain:
            depths = torch.tensor([0, *draft.depths().tolist()], device=self.model.device)
            positions = self.cache.next_position + depths
            tree_mask = draft.ancestor_mask(self.model.device)
        segment = SegmentInput(self.cache, [root, *draft.tokens.tolist()], positions, tree_mask)
        rows = min(FIRST_ROWS, draft.num_nodes + 1) if lazy_head else draft.num_nodes + 1
        return Round(segment, rows=rows, past=past, draft=draft, prefill=False, draft_s=draft_s)

    def finish(
        self,
        rnd: Round,
        out: PackedOutput,
        start: int,
        first_logits: torch.Tensor,
        verify_s: float,
        layers: tuple[int, ...] | None = None,
    ):
        """Apply the forward's result; returns the TokenEvents this round produced.

        start: the segment's first packed row; first_logits: [rnd.rows, V] its rows' logits; layers: the target
        layers out.hidden holds, in order (None: this request's drafter's own)."""
        assert self.cache is not None
        end = start + len(rnd.segment.input_ids)
        hidden = out.hidden[start:end][None] if out.hidden is not None else None  # [1, T, k*H]
        if self.drafter is None or not tuple(self.drafter.hidden_layers):  # no features wanted (plain, n-gram)
            hidden = None
        elif hidden is not None and layers is not None and tuple(self.drafter.hidden_layers) != layers:
            hidden = own_layers(hidden, layers, tuple(self.drafter.hidden_layers))
        if rnd.prefill:
            self.prefilled += len(rnd.segment.input_ids)
            if hidden is not None and (self._prefill_hidden or not rnd.prefill_done):
                self._prefill_hidden.append(hidden)
                hidden = torch.cat(self._prefill_hidden, dim=1) if rnd.prefill_done else None
            if not rnd.prefill_done:
                return []
            self.phase, self._prefill_hidden = Phase.RUNNING, []
            if self.tokens:  # recomputed after a preemption: the root is already chosen
                if self.drafter is not None:
                    self.drafter.start(self.tokens[:-1], hidden, self.params, self.generator, self.select.draft_adjust)
                return []
            event = self.select.choose(first_logits[0])
            self.tokens = [*self.prompt_ids, event.token_id]
            if self.drafter is not None:
                self.drafter.start(self.prompt_ids, hidden, self.params, self.generator, self.select.draft_adjust)
            return [event]
        draft = rnd.draft
        if draft is None:  # a plain step
            event = self.select.choose(first_logits[0])
            self.tokens.append(event.token_id)
            self.stats.record(0, 0, 0, 0.0, verify_s)
            return [event]
        logits: torch.Tensor | TargetRows = first_logits
        if first_logits.shape[0] < draft.num_nodes + 1:  # the rest of the rows on demand (verify/rows.py)
            assert out.final is not None
            final, vocab = out.final[start:end], self.model.vocab_size
            logits = TargetRows(final, self.model.head, draft.children(), vocab, known=first_logits)
        verdict, events = self.select.verify(draft, logits)
        if verdict.path:
            dev = self.model.device
            path = torch.tensor(verdict.path, dtype=torch.long, device=dev)
            self.cache.commit(rnd.past + 1, rnd.past + 1 + path)
            if hidden is not None:
                keep = torch.tensor([0, *(i + 1 for i in verdict.path)], dtype=torch.long, device=dev)
                hidden = hidden[:, keep]  # [1, 1+a, k*H]
        else:  # nothing accepted (or nothing drafted): the root's slot and features alone
            self.cache.crop(rnd.past + 1)
            if hidden is not None:
                hidden = hidden[:, :1].clone()  # its own storage: the drafter may queue it for rounds
        assert self.drafter is not None
        self.drafter.observe(verdict, hidden)
        depth = int(draft.depths().max()) if draft.num_nodes else 0
        self.stats.record(depth, draft.num_nodes, verdict.num_accepted, rnd.draft_s, verify_s)
        self.tokens.extend(verdict.tokens)
        self.last_rows, self.last_emitted = draft.num_nodes + 1, len(verdict.tokens)
        return events
