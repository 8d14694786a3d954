"""One denoising step of a mask-absorbing model: propose a token and a confidence for every masked
position, then let the sampler's rule pick which proposals become permanent."""

from __future__ import annotations

from collections.abc import Callable

import torch

from byblock.dllm.config import DllmConfig, SamplerKind
from byblock.dllm.entropy_bound import entropy, select_entropy_bound
from byblock.dllm.factor import select_factor
from byblock.dllm.low_confidence import select_low_confidence, transfer_schedule
from byblock.dllm.threshold import select_threshold

# (confidence [B, L], masked [B, L], entropy [B, L], k [B] for scheduled samplers) -> reveal [B, L]
MaskRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def propose(
    logits: torch.Tensor, temperature: float, mask_token_id: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, L, V] -> (tokens [B, L], confidence [B, L], entropy [B, L]).

    Greedy (T = 0) proposes the argmax; otherwise a Gumbel-max draw at temperature T (as Fast-dLLM's
    add_gumbel_noise, via the exponential race). Confidence is the untempered probability of the proposal
    in float64 (Fast-dLLM computes it in float64 too). The mask token itself is never proposed.
    """
    logits = logits.double()
    logits[..., mask_token_id] = float("-inf")
    probs = torch.softmax(logits, -1)
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        tokens = (torch.log_softmax(logits / temperature, -1) - race.log()).argmax(-1)
    conf = probs.gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, conf, entropy(logits)


def make_rule(cfg: DllmConfig) -> MaskRule:
    """The sampler's reveal rule, resolved once per request (no dispatch inside the step loop)."""
    if cfg.sampler is SamplerKind.LOW_CONFIDENCE:
        return lambda conf, masked, ent, k: select_low_confidence(conf, masked, k)
    if cfg.sampler is SamplerKind.THRESHOLD:
        return lambda conf, masked, ent, k: select_threshold(conf, masked, cfg.threshold)
    if cfg.sampler is SamplerKind.FACTOR:
        return lambda conf, masked, ent, k: select_factor(conf, masked, cfg.factor)
    if cfg.sampler is SamplerKind.ENTROPY:
        return lambda conf, masked, ent, k: select_entropy_bound(ent, masked, cfg.entropy_bound)
    raise ValueError(f"{cfg.sampler} is not a mask-absorbing sampler")


class MaskBlock:
    """One block's canvas under a mask sampler, one denoising step at a time: what the solo loop
    (dllm/generate.py) and the batched engine (engine/dllm_batched.py) both run, so they decide alike."""

    def __init__(
        self, cfg: DllmConfig, block: int, mask_token_id: int, generator: torch.Generator | None, device
    ) -> None:
        self.cfg = cfg
        self.mask_id = mask_token_id
        self.generator = generator
        self.rule = make_rule(cfg)
        self.block = block
        self.canvas = torch.full((1, block), mask_token_id, device=device)  # [1, L]
        self.cap = cfg.steps or block
        self.schedule = transfer_schedule(block, self.cap) if cfg.sampler is SamplerKind.LOW_CONFIDENCE else None
        self.steps = 0
        self.done = False

    def step(self, logits: torch.Tensor) -> None:
        """Apply one denoising step's logits [1, L, V] (float32); sets `done` once nothing is masked."""
        tokens, conf, ent = propose(logits, self.cfg.temperature, self.mask_id, self.generator)
        masked = self.canvas == self.mask_id
        sched = self.schedule
        k = torch.tensor([sched[self.steps] if sched and self.steps < len(sched) else self.block], device=masked.device)
        capped = sched is None and self.steps + 1 >= self.cap  # the step cap: decide everything left
        reveal = masked if capped else self.rule(conf, masked, ent, k)
        self.canvas = torch.where(reveal, tokens, self.canvas)
        self.steps += 1
        self.done = not bool((self.canvas == self.mask_id).any())  # every step reveals >= 1 token
