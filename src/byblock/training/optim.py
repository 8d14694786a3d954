"""The drafter trainer's optimizer: AdamW, or MiMo's recipe of Muon for the weight matrices.

Muon (torch.optim.Muon, orthogonalised momentum by Newton-Schulz) updates the 2-D weight matrices of the draft
layers; AdamW keeps everything else (norms, biases, the fusion's and heads' vectors and embeddings), as Muon's
authors and MiMo do. `adjust_lr_fn="match_rms_adamw"` scales Muon's update to AdamW's RMS, so one --lr and one
schedule drive both. The pair behaves as one optimizer for the trainer: param_groups (the schedule sets every
group's lr), step, zero_grad, and a state dict that resumes both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _Pair:
    """Two optimizers stepped together."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.parts = (first, second)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every group of both (the trainer's schedule sets their lr)."""
        return [g for opt in self.parts for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear both optimizers' gradients."""
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One update of every parameter."""
        for opt in self.parts:
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        """Both states, for a resumable checkpoint."""
        return {"pair": [opt.state_dict() for opt in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume both (a checkpoint of another optimizer is refused by the trainer's recipe check first)."""
        for opt, s in zip(self.parts, state["pair"], strict=True):
            opt.load_state_dict(s)


def build_optimizer(net: nn.Module, kind: str, lr: float, weight_decay: float):
    """AdamW over every trainable parameter (decay on matrices only), or Muon + AdamW ("muon")."""
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if p.ndim == 2 and "layers." in n] if kind == "muon" else []
    picked = {id(p) for p in matrices}
    rest = [(n, p) for n, p in named if id(p) not in picked]
    decay = [p for _, p in rest if p.ndim >= 2]
    no_decay = [p for _, p in rest if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    if kind != "muon":
        return adamw
    muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
    return _Pair(muon, adamw)
