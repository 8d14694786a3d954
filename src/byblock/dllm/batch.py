"""Batched block diffusion for mask-absorbing models, invariant to batch composition.

Several requests share every forward, yet each gets exactly the tokens it gets alone:
- prompts are left-padded; pad slots are masked out of every attention row and each row's RoPE positions
  start at 0 where its own prompt starts, so a row sees exactly what it sees alone;
- every request has its own generator (its own seed) and its own reveal decisions, taken row by row;
- rows move through blocks in lockstep: a row whose block is decided waits (its canvas is frozen) until the
  slowest row finishes, then all blocks are committed together in one pass.
The forwards cost the same for a row whether it waits or not; what batching buys is one weight read for
all rows (the memory-bound regime of seed 000's roofline).
"""

from __future__ import annotations

import math
import time

import torch

from byblock.dllm.config import DllmConfig, SamplerKind
from byblock.dllm.denoisers import MaskDenoiser
from byblock.dllm.generate import DllmResult, check_sampler
from byblock.dllm.low_confidence import transfer_schedule
from byblock.dllm.mask_step import make_rule, propose
from byblock.kv.kv_cache import KVCache
from byblock.sampling.processors import make_generator


class _BatchSession:
    """The committed context of a left-padded batch, in one KV cache."""

    def __init__(self, model: MaskDenoiser, prompts: list[list[int]], pad_id: int) -> None:
        self.m = model
        self.device = dev = model.device
        width = max(len(p) for p in prompts)
        self.pad = torch.tensor([width - len(p) for p in prompts], device=dev)  # [B] left-pad per row
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=dev)  # [B, P]
        self.valid = ids.new_ones(ids.shape, dtype=torch.bool)
        self.valid &= torch.arange(width, device=dev)[None, :] >= self.pad[:, None]  # [B, P] real (non-pad) slots
        self.cache = KVCache(device=dev)
        causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=dev))
        allowed = causal[None] & self.valid[:, None, :]  # [B, P, P]
        # pad queries see themselves (no all-masked rows)
        allowed |= torch.eye(width, dtype=torch.bool, device=dev)[None]
        self._forward(ids, allowed)

    def _positions(self, start: int, t: int) -> torch.Tensor:
        """[B, t] RoPE positions: slot index minus the row's padding (a row's first real token is position 0)."""
        return (torch.arange(start, start + t, device=self.device)[None, :] - self.pad[:, None]).clamp_min(0)

    def _forward(self, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """ids [B, t] appended after the cache; allowed [B, t, past+t] bool -> logits [B, t, V]."""
        past = self.cache.length
        neg = torch.finfo(self.m.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.m.dtype, device=self.device).masked_fill(~allowed, neg)[:, None]
        pos = self._positions(past, ids.shape[1])
        return self.m.hf(
            input_ids=ids, cache=self.cache.hf, position_ids=pos, attention_mask=mask, use_cache=True
        ).logits

    def _block_allowed(self, t: int) -> torch.Tensor:
        past, b = self.cache.length, self.valid.shape[0]
        later = torch.ones(b, past - self.valid.shape[1], dtype=torch.bool, device=self.device)  # committed blocks
        seen = torch.cat([self.valid, later], 1)
        block = torch.ones(b, t, t, dtype=torch.bool, device=self.device)
        return torch.cat([seen[:, None, :].expand(-1, t, -1), block], dim=2)

    @torch.inference_mode()
    def denoise(self, canvas: torch.Tensor) -> torch.Tensor:
        """Canvas [B, L] -> logits [B, L, V]; reads the cache, crops what it appended."""
        past = self.cache.length
        logits = self._forward(canvas, self._block_allowed(canvas.shape[1]))
        self.cache.crop(past)
        return logits.float()

    @torch.inference_mode()
    def commit(self, block: torch.Tensor) -> None:
        """Write a finished block [B, L] (bidirectional inside, sees every real slot before it)."""
        self._forward(block, self._block_allowed(block.shape[1]))


def diffusion_generate_batch(
    model: MaskDenoiser,
    prompts: list[list[int]],
    cfg: DllmConfig,
    seeds: list[int | None] | None = None,
    eos_token_ids: frozenset[int] | set[int] = frozenset(),
) -> list[DllmResult]:
    """Decode several requests together; request i uses seed seeds[i] (default cfg.seed for all).

    Returns one DllmResult per request, equal to what diffusion_generate returns for it alone. nfe counts
    the forwards each row actually needed (its own steps), not the lockstep ones it waited through."""
    check_sampler(model, cfg)
    assert model.mask_token_id is not None
    start = time.perf_counter()
    b = len(prompts)
    seeds = seeds if seeds is not None else [cfg.seed] * b
    device = model.device
    gens = [make_generator(s, device) for s in seeds]
    block = cfg.block_size or model.default_block_size
    session = _BatchSession(model, prompts, pad_id=0)
    rule = make_rule(cfg)
    mask_id = model.mask_token_id
    outs: list[list[int]] = [[] for _ in range(b)]
    finished = [False] * b
    steps_per_block: list[list[int]] = [[] for _ in range(b)]
    reasons = ["length"] * b
    steps_cap = cfg.steps or block
    schedule = transfer_schedule(block, steps_cap) if cfg.sampler is SamplerKind.LOW_CONFIDENCE else None
    canvas = torch.full((b, block), mask_id, device=device)
    for blk in range(math.ceil(cfg.max_new_tokens / block)):
        if blk:
            session.commit(canvas)
            canvas = torch.full((b, block), mask_id, device=device)
        steps = [0] * b
        while bool((canvas == mask_id).any()):
            logits = session.denoise(canvas)  # [B, L, V], one forward for every row
            for i in range(b):
                row_masked = canvas[i : i + 1] == mask_id
                if not bool(row_masked.any()):
                    continue  # this row's block is decided: it waits
                tokens, conf, ent = propose(logits[i : i + 1], cfg.temperature, mask_id, gens[i])
                k = torch.tensor(
                    [schedule[steps[i]] if schedule and steps[i] < len(schedule) else block], device=device
                )
                capped = schedule is None and steps[i] + 1 >= steps_cap
                reveal = row_masked if capped else rule(conf, row_masked, ent, k)
                canvas[i : i + 1] = torch.where(reveal, tokens, canvas[i : i + 1])
                steps[i] += 1
        for i in range(b):
            if finished[i]:
                continue
            steps_per_block[i].append(steps[i])
            for tok in canvas[i].tolist()[: cfg.max_new_tokens - len(outs[i])]:
                outs[i].append(tok)
                if tok in eos_token_ids:
                    finished[i], reasons[i] = True, "stop"
                    break
            finished[i] = finished[i] or len(outs[i]) >= cfg.max_new_tokens
        if all(finished):
            break
    total = time.perf_counter() - start
    return [
        DllmResult(outs[i], reasons[i], sum(steps_per_block[i]), len(steps_per_block[i]) - 1, steps_per_block[i], total)
        for i in range(b)
    ]
