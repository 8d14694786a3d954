"""Plain autoregressive decoding: the baseline every speedup is measured against, so it carries no
per-token work it does not need (one forward, one argmax or draw, one yield)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from byblock.engine.selector import TokenSelector
from byblock.engine.types import SpecStats, TokenEvent
from byblock.models.adapter import TargetModel
from byblock.models.devices import device_clock
from byblock.sampling.params import SamplingParams


def plain_decode(
    target: TargetModel,
    prompt_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: SpecStats,
) -> Iterator[TokenEvent]:
    """Yield target tokens one at a time, forever; the consumer stops by closing the iterator."""
    cache = target.new_cache()
    dev = target.device
    clock = device_clock(dev)
    select = TokenSelector(params, generator, prompt_ids, target)
    logits = target.forward(torch.tensor([prompt_ids], device=dev), cache, logits_to_keep=1).logits  # [1, 1, V]
    event = select.choose(logits[0, -1])
    while True:
        yield event
        t0 = clock()
        cache.evict()  # StreamingLLM caches drop what the next query cannot see (no-op otherwise)
        logits = target.forward(torch.tensor([[event.token_id]], device=dev), cache, logits_to_keep=1).logits
        event = select.choose(logits[0, -1])
        stats.record(0, 0, 0, 0.0, clock() - t0)
