"""Drafters: propose candidate blocks/trees. `build_drafter` turns a CLI/API spec into one, resolved once."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from byblock.drafters.base import Drafter
from byblock.drafters.draft_model import ModelDrafter, check_same_vocabulary
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel


class DrafterKind(Enum):
    """The drafting methods byblock knows."""

    NONE = "none"
    NGRAM = "ngram"
    MODEL = "model"


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed `--drafter` value plus its knobs."""

    kind: DrafterKind
    model: str | None = None  # for MODEL
    block_size: int = 8
    num_candidates: int = 1
    tree_budget: int = 32
    ngram_min: int = 1
    ngram_max: int = 3

    @staticmethod
    def parse(text: str, **knobs: int) -> DrafterSpec:
        """'none' | 'ngram' | 'model:ID' -> DrafterSpec (a one-line error for anything else)."""
        name, _, arg = text.partition(":")
        try:
            kind = DrafterKind(name)
        except ValueError:
            choices = "none, ngram, model:ID"
            raise ByblockError(f"unknown drafter '{text}' (choose from {choices})") from None
        if kind is DrafterKind.MODEL and not arg:
            raise ByblockError("drafter 'model' needs a model: --drafter model:ID")
        if kind is not DrafterKind.MODEL and arg:
            raise ByblockError(f"drafter '{name}' takes no ':{arg}' argument")
        for knob in ("block_size", "num_candidates", "tree_budget", "ngram_min", "ngram_max"):
            if knobs.get(knob, 1) < 1:
                raise ByblockError(f"--{knob.replace('_', '-')} must be >= 1")
        if knobs.get("ngram_min", 1) > knobs.get("ngram_max", 3):
            raise ByblockError("--ngram-min must not exceed --ngram-max")
        return DrafterSpec(kind=kind, model=arg or None, **knobs)


def build_drafter(spec: DrafterSpec, target: TargetModel, dtype: str = "float32") -> Drafter | None:
    """Instantiate the drafter a spec names (None for plain decoding)."""
    if spec.kind is DrafterKind.NONE:
        return None
    if spec.kind is DrafterKind.NGRAM:
        cfg = NgramConfig(
            block_size=spec.block_size,
            min_n=spec.ngram_min,
            max_n=spec.ngram_max,
            num_candidates=spec.num_candidates,
            tree_budget=spec.tree_budget,
        )
        return NgramDrafter(cfg)
    from byblock.models.loading import load_model

    assert spec.model is not None
    draft = load_model(spec.model, dtype=dtype)
    check_same_vocabulary(draft, target)
    return ModelDrafter(draft, target_vocab=target.vocab_size, block_size=spec.block_size)


__all__ = [
    "Drafter",
    "DrafterKind",
    "DrafterSpec",
    "ModelDrafter",
    "NgramConfig",
    "NgramDrafter",
    "build_drafter",
]
