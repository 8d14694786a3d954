"""The speculative loop: draft → verify → commit → emit, one round per target forward.

Invariant between rounds: `tokens` holds every committed token; the target cache holds the K/V of all
but the last one (the root), whose K/V is computed in the next round's forward together with the draft.

    round:  input  = [root, x_1 .. x_N]            positions past + [0, depth_1 .. depth_N]
            logits = target(input)                  row 0 predicts after root, row i+1 after x_i;
                                                    the LM head runs only on the rows verify reads
            verdict= select.verify(draft, logits)   accepted path x_{i_1}..x_{i_a} + one target token
            cache  = keep(prefix, root, path)       compact: a tree's accepted nodes are not contiguous
            emit     path tokens (from_draft) then the target token (the new root)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from byblock.drafters.base import Drafter
from byblock.engine.selector import TokenSelector
from byblock.engine.types import SpecStats, TokenEvent
from byblock.models.adapter import TargetModel
from byblock.models.devices import device_clock
from byblock.sampling.params import SamplingParams
from byblock.verify import Draft, TargetRows
from byblock.verify.specguard import SpecGuardConfig


def speculative_decode(
    target: TargetModel,
    drafter: Drafter,
    prompt_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: SpecStats,
    guard: SpecGuardConfig | None = None,
) -> Iterator[TokenEvent]:
    """Yield tokens, several per target forward; output identical (greedy) / equal in law (sampling)
    to plain_decode. The consumer stops by closing the iterator, mid-block if it likes. guard: SpecGuard's
    step-level acceptance instead (NOT lossless, verify/specguard.py)."""
    layers = drafter.hidden_layers
    dev = target.device  # draft metadata (tokens, parents, paths) stays on the host; what the model reads goes here
    clock = device_clock(dev)  # on a GPU, waits for the queued work: draft and verify times are the device's
    # On the CPU the head runs only on the rows a walk reads (compute saved); on a GPU the head over every row
    # costs about what one row does, and dense logits let greedy verification sync once per round.
    lazy_head = dev.type == "cpu"
    cache = target.new_cache()
    select = TokenSelector(params, generator, prompt_ids, target, guard)  # penalties, grammar, sampling, logprobs
    out = target.forward(
        torch.tensor([prompt_ids], device=dev), cache, logits_to_keep=1, hidden_layers=layers
    )  # logits [1, 1, V]; hidden [1, T, k*H] or None
    first = select.choose(out.logits[0, -1])
    tokens = [*prompt_ids, first.token_id]
    drafter.start(prompt_ids, out.hidden, params, generator, select.draft_adjust)
    yield first
    emitted = 1
    while True:
        # Never draft past what can still be emitted (the round adds one token of its own) or the context.
        depth_budget = min(params.max_new_tokens - emitted, target.max_context - len(tokens)) - 1
        t0 = clock()
        draft = select.trim(drafter.propose(tokens, depth_budget)) if depth_budget > 0 else Draft.empty()
        t1 = clock()

        cache.evict()  # StreamingLLM caches drop what the next query cannot see (no-op otherwise)
        past = cache.length  # slots; == len(tokens) - 1 unless the cache evicts
        root_pos = cache.next_position  # the root's absolute position == len(tokens) - 1
        node_depths = draft.depths()  # [N]
        input_ids = torch.tensor([[tokens[-1], *draft.tokens.tolist()]], device=dev)  # [1, 1+N]
        positions = tree_mask = None
        if not draft.is_chain:
            depths = [0, *node_depths.tolist()]  # [1+N]
            positions = torch.tensor([[root_pos + d for d in depths]], device=dev)
            tree_mask = draft.ancestor_mask(dev)
        out = target.forward(
            input_ids, cache, positions=positions, tree_mask=tree_mask, hidden_layers=layers, defer_logits=lazy_head
        )
        # The LM head runs only on the rows verification reads (verify/rows.py), where the model allows it.
        logits = out.logits[0] if out.logits is not None else target_rows(target, out.final[0], draft)
        verdict, events = select.verify(draft, logits)
        # Commit: keep the root's slot and the accepted nodes' slots (node i sits at slot past + 1 + i).
        path = torch.tensor(verdict.path, dtype=torch.long, device=dev)
        cache.commit(past + 1, past + 1 + path)
        hidden = None
        if out.hidden is not None:
            rows = torch.tensor([0, *(i + 1 for i in verdict.path)], dtype=torch.long, device=dev)
            hidden = out.hidden[:, rows]  # [1, 1+a, k*H]
        drafter.observe(verdict, hidden)
        t2 = clock()
        depth = int(node_depths.max()) if draft.num_nodes else 0
        stats.record(depth, draft.num_nodes, verdict.num_accepted, t1 - t0, t2 - t1)
        stats.guard_tokens = select.guard_tokens

        for event in events:
            tokens.append(event.token_id)
            yield event
            emitted += 1


def target_rows(target: TargetModel, final: torch.Tensor, draft: Draft) -> TargetRows:
    """The target's logits for `draft`'s verify rows (final: [N+1, H]), computed as verification reads them."""
    return TargetRows(final, target.head, draft.children(), target.vocab_size)
