"""DiffusionGemma's uniform-state denoising step: no mask token, nothing is ever locked.

Each step (transformers generation_diffusion_gemma.py, reproduced token for token — see the parity test):
  t       = t_min + (t_max − t_min) · s/N          s = N..1 (anneals t_max → t_min)
  p       = softmax(logits / t);  x̃ ~ p;  x̂ = argmax
  accept  = entropy-bound set of positions (entropy of p, bound γ)
  canvas  = x̃ where accepted, fresh uniform-random tokens elsewhere ("renoise")
  stop    when x̂ equals the previous `stability` argmax canvases and mean entropy < `confidence`
The emitted block is the last argmax canvas; the tempered logits condition the next step (self-conditioning).
Random draws, in order per step: one multinomial over [B·L, V], one randint [B, L] — as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from byblock.dllm.config import DllmConfig
from byblock.dllm.entropy_bound import entropy, select_entropy_bound


@dataclass
class RenoiseState:
    """One canvas being denoised (batch rows side by side)."""

    canvas: torch.Tensor  # [B, L] the model's input at the next step
    argmax: torch.Tensor  # [B, L] the current answer
    self_cond: torch.Tensor | None  # [B, L, V] tempered logits of the previous step
    history: torch.Tensor  # [stability, B, L] previous argmax canvases (-1: none yet)
    done: torch.Tensor  # [B] bool


def init_state(
    batch: int,
    length: int,
    vocab: int,
    stability: int,
    generator: torch.Generator | None,
    device: torch.device | str = "cpu",
) -> RenoiseState:
    """A canvas of uniform random tokens (one randint draw, as transformers) on `device`, the model's (the
    generator must live there too)."""
    canvas = torch.randint(0, vocab, (batch, length), generator=generator, device=device)
    return RenoiseState(
        canvas=canvas,
        argmax=canvas,
        self_cond=None,
        history=torch.full((stability, batch, length), -1, device=device),
        done=torch.zeros(batch, dtype=torch.bool, device=device),
    )


def renoise_step(
    state: RenoiseState, logits: torch.Tensor, cur_step: int, cfg: DllmConfig, generator: torch.Generator | None
) -> int:
    """Advance the canvas by one step given its logits [B, L, V]; returns how many positions were accepted."""
    b, length, vocab = logits.shape
    device = logits.device
    n = cfg.steps or 48
    frac = torch.tensor(cur_step, dtype=torch.int32, device=device) / n  # float32, exactly as transformers computes it
    proc = logits / (cfg.t_min + (cfg.t_max - cfg.t_min) * frac)
    probs = torch.softmax(proc, -1, dtype=torch.float32)
    sampled = torch.multinomial(probs.view(-1, vocab), 1, generator=generator).view(b, length)
    new_argmax = proc.argmax(-1)
    accepted = select_entropy_bound(entropy(proc), torch.ones_like(sampled, dtype=torch.bool), cfg.entropy_bound)
    noise = torch.randint(0, vocab, (b, length), generator=generator, device=device)
    new_canvas = torch.where(accepted, sampled, noise)
    done = state.done
    if done.any():  # finished rows keep their canvas, answer and conditioning
        new_argmax = torch.where(done[:, None], state.argmax, new_argmax)
        new_canvas = torch.where(done[:, None], state.canvas, new_canvas)
        proc = torch.where(done[:, None, None], state.self_cond, proc)
    if cfg.stability == 0:
        stable = torch.ones(b, dtype=torch.bool, device=device)
    else:
        stable = (state.history == new_argmax[None]).all(-1).all(0)
        state.history = torch.roll(state.history, -1, 0)
        state.history[-1] = new_argmax
    confident = entropy(proc).mean(-1) < cfg.confidence
    state.done = done | (stable & confident)
    state.canvas, state.argmax, state.self_cond = new_canvas, new_argmax, proc
    return int((accepted & ~done[:, None]).sum())
