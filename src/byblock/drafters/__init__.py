"""Drafters: propose candidate blocks/trees. `build_drafter` turns a CLI/API spec into one, resolved once."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from weakref import WeakKeyDictionary

import torch

from byblock.drafters.base import Drafter
from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.draft_model import ModelDrafter, check_same_vocabulary
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.models.host_memory import release_freed_memory


class DrafterKind(Enum):
    """The drafting methods byblock knows."""

    NONE = "none"
    NGRAM = "ngram"
    MODEL = "model"
    DFLASH = "dflash"
    DDTREE = "ddtree"
    DOMINO = "domino"
    DOMINO_TREE = "dominotree"
    HYBRID = "hybrid"
    EAGLE3 = "eagle3"  # EAGLE-3 head, chains
    EAGLE3_TREE = "eagle3tree"  # EAGLE-3 head, EAGLE-2 dynamic trees (tree_budget nodes)


# Drafters shipped inside the package, per built-in target (drafters/weights/<dir>).
SHIPPED_DFLASH = {"smollm2-135m": "smollm2-135m-dflash"}
SHIPPED_EAGLE3 = {"smollm2-135m": "smollm2-135m-eagle3"}
EAGLE3_TOP_K = 8  # children expanded per frontier node and frontier width (EAGLE-2's top-k)
DEFAULT_BLOCK = 8


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed `--drafter` value plus its knobs."""

    kind: DrafterKind
    model: str | None = None  # MODEL: a model id; DFLASH / EAGLE3: a checkpoint dir (None: the shipped one)
    block_size: int | None = None  # tokens per verify forward (anchor + B-1 drafts); None: the drafter's default
    num_candidates: int = 1
    tree_budget: int = 31  # + the root = 32 verify rows: one linear pass (kernels/invariant.py ROW_CHUNK)
    ngram_min: int = 1
    ngram_max: int = 3
    adaptive: bool = False  # dflash/ddtree: pick depth/budget per round from measured costs (drafters/adaptive.py)

    @staticmethod
    def parse(text: str, **knobs: int | bool | None) -> DrafterSpec:
        """'none' | 'ngram' | 'model:ID' | '[adaptive-]dflash|ddtree|hybrid[:PATH]' | 'domino|dominotree[:PATH]'
        | 'eagle3|eagle3tree[:PATH]' -> DrafterSpec ('adaptive-X' is X with adaptive=True: the form a server's
        --drafter list takes).

        Anything else is a one-line error."""
        name, _, arg = text.partition(":")
        if name.startswith("adaptive-"):
            name, knobs = name.removeprefix("adaptive-"), {**knobs, "adaptive": True}
        try:
            kind = DrafterKind(name)
        except ValueError:
            choices = "none, ngram, model:ID, [adaptive-]dflash|ddtree|hybrid[:PATH], domino|dominotree[:PATH], "
            choices += "eagle3|eagle3tree[:PATH]"
            raise ByblockError(f"unknown drafter '{text}' (choose from {choices})") from None
        if kind is DrafterKind.MODEL and not arg:
            raise ByblockError("drafter 'model' needs a model: --drafter model:ID")
        if kind in (DrafterKind.NONE, DrafterKind.NGRAM) and arg:
            raise ByblockError(f"drafter '{name}' takes no ':{arg}' argument")
        for knob in ("num_candidates", "tree_budget", "ngram_min", "ngram_max"):
            if knobs.get(knob, 1) < 1:
                raise ByblockError(f"--{knob.replace('_', '-')} must be >= 1")
        if knobs.get("block_size") is not None and knobs["block_size"] < 2:
            raise ByblockError("--block-size must be >= 2 (the anchor plus at least one drafted token)")
        if knobs.get("adaptive") and kind not in (DrafterKind.DFLASH, DrafterKind.DDTREE, DrafterKind.HYBRID):
            raise ByblockError("--adaptive works with --drafter dflash, ddtree or hybrid")
        if knobs.get("ngram_min", 1) > knobs.get("ngram_max", 3):
            raise ByblockError("--ngram-min must not exceed --ngram-max")
        return DrafterSpec(kind=kind, model=arg or None, **knobs)


def build_drafter(spec: DrafterSpec, target: TargetModel, dtype: str = "float32") -> Drafter | None:
    """Instantiate the drafter a spec names (None for plain decoding)."""
    if spec.kind is DrafterKind.NONE:
        return None
    depth = (spec.block_size or DEFAULT_BLOCK) - 1
    if spec.kind is DrafterKind.NGRAM:
        cfg = NgramConfig(
            block_size=depth,
            min_n=spec.ngram_min,
            max_n=spec.ngram_max,
            num_candidates=spec.num_candidates,
            tree_budget=spec.tree_budget,
        )
        return NgramDrafter(cfg)
    if spec.adaptive:
        from byblock.drafters.adaptive import AdaptiveDrafter

        tree = spec.kind in (DrafterKind.DDTREE, DrafterKind.HYBRID)
        dflash = build_dflash(spec, target, dtype)
        lookup = None
        if spec.kind is DrafterKind.HYBRID:
            lookup = NgramDrafter(NgramConfig(block_size=dflash.block_size, min_n=spec.ngram_min, max_n=spec.ngram_max))
        cost = measured_costs(target, spec.tree_budget)
        return AdaptiveDrafter(dflash, target, tree=tree, max_budget=spec.tree_budget, cost=cost, lookup=lookup)
    if spec.kind is DrafterKind.DFLASH:
        return build_dflash(spec, target, dtype)
    if spec.kind in (DrafterKind.EAGLE3, DrafterKind.EAGLE3_TREE):
        return build_eagle3(spec, target, dtype)
    if spec.kind is DrafterKind.DDTREE:
        return DDTreeDrafter(build_dflash(spec, target, dtype), budget=spec.tree_budget)
    if spec.kind is DrafterKind.HYBRID:
        from byblock.drafters.hybrid import HybridDrafter

        ddtree = DDTreeDrafter(build_dflash(spec, target, dtype), budget=spec.tree_budget)
        lookup = NgramDrafter(NgramConfig(block_size=ddtree.block_size, min_n=spec.ngram_min, max_n=spec.ngram_max))
        return HybridDrafter(lookup, ddtree, budget=spec.tree_budget)
    if spec.kind in (DrafterKind.DOMINO, DrafterKind.DOMINO_TREE):
        from byblock.drafters.domino import DominoDrafter, load_domino

        backbone = build_dflash(spec, target, dtype)
        path = Path(spec.model).expanduser() if spec.model else shipped_dflash_dir(target.name)
        head = load_domino(path, target.hidden_size).to(target.device)
        budget = spec.tree_budget if spec.kind is DrafterKind.DOMINO_TREE else 0
        return DominoDrafter(backbone, head, tree_budget=budget)
    from byblock.models.loading import load_model

    assert spec.model is not None
    draft = load_model(spec.model, device=target.device, dtype=dtype, row_invariant=False)  # needs no invariance
    check_same_vocabulary(draft, target)
    return ModelDrafter(draft, target_vocab=target.vocab_size, block_size=depth)


_COSTS: WeakKeyDictionary = WeakKeyDictionary()  # target -> {max budget: CostModel}, measured once per target


def measured_costs(target: TargetModel, max_budget: int):
    """The target's verify-cost curve up to max_budget + 1 rows (drafters/adaptive.py), measured once per target
    and budget: a server loading adaptive-dflash and adaptive-hybrid measures it once, not twice."""
    from byblock.drafters.costs import COST_SIZES, CostModel, measure_verify_cost

    per_budget = _COSTS.setdefault(target, {})
    if max_budget not in per_budget:
        per_budget[max_budget] = CostModel(measure_verify_cost(target, [k for k in COST_SIZES if k <= max_budget + 1]))
    return per_budget[max_budget]


def shipped_dflash_dir(target_name: str) -> Path:
    """The DFlash checkpoint shipped for a built-in target (a one-line error when there is none)."""
    sub = SHIPPED_DFLASH.get(target_name)
    path = Path(__file__).parent / "weights" / sub if sub else None
    if path is None or not (path / "config.json").is_file():
        raise ByblockError(f"no DFlash drafter ships for model '{target_name}': pass one with --drafter dflash:PATH")
    return path


def _own_copies(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give the float parameters their own memory, in `dtype`. Loaded, they are views of the mapped checkpoint;
    while one lives, every page of it a re-layout read stays resident beside the re-laid-out copy."""
    for param in model.parameters():
        param.data = param.data.to(dtype, copy=True)


def build_dflash(spec: DrafterSpec, target: TargetModel, dtype: str = "float32") -> DFlashDrafter:
    """A DFlash drafter from a checkpoint dir (or the one shipped for the target), in the target's dtype, on the
    target's kernels (int8 groups beside a quantized target, packed fp32 beside a packed one)."""
    from byblock.drafters.dflash_format import load_dflash
    from byblock.kernels import invariant_head
    from byblock.kernels.packed_gemm import load_kernel, pack_linears
    from byblock.kernels.quant_gemm import QuantLinear, quantize_linears
    from byblock.models.loading import DTYPES

    path = Path(spec.model).expanduser() if spec.model else shipped_dflash_dir(target.name)
    want = DTYPES.get(dtype, torch.float32)
    model, vocab = load_dflash(path, dtype=None)  # as stored (the shipped one: bf16), mapped from the file
    model = model.to(target.device)  # the drafter runs beside its target, reading the target's embedding and head
    vocab = None if vocab is None else vocab.to(target.device)
    head = target.hf.get_output_embeddings()
    if want == torch.float32 and isinstance(head, QuantLinear):
        # A quantized target runs ~2x cheaper per step; an fp32 drafter beside it would eat the gain. int8 groups
        # (not int4) keep the drafter's proposals, and so its acceptance, closest to the fp32 drafter's. Quantized
        # straight from the file's tensors (the same values as from their fp32 conversion), one linear at a time.
        quantize_linears(model, 8, head.kernel)
        _own_copies(model, want)
    elif want == torch.float32 and invariant_head(head) is not None and (kernel := load_kernel()) is not None:
        model = model.to(want)
        pack_linears(model, kernel)  # the drafter follows the target onto row-invariant kernels (packed fp32)
        _own_copies(model, want)
    else:
        model = model.to(want)
    drafter = DFlashDrafter(model, target, block=spec.block_size, draft_vocab=vocab)
    release_freed_memory()  # the conversion's temporaries
    return drafter


def build_eagle3(spec: DrafterSpec, target: TargetModel, dtype: str = "float32"):
    """An EAGLE-3 drafter from a checkpoint dir (or the one shipped for the target): a chain of block_size − 1
    tokens, or (eagle3tree) a dynamic tree of tree_budget nodes as deep as that."""
    from byblock.drafters.eagle3 import Eagle3Drafter
    from byblock.drafters.eagle3_format import load_eagle3
    from byblock.models.loading import DTYPES

    if spec.model:
        path = Path(spec.model).expanduser()
    else:
        sub = SHIPPED_EAGLE3.get(target.name)
        path = Path(__file__).parent / "weights" / sub if sub else None
        if path is None or not (path / "config.json").is_file():
            raise ByblockError(f"no EAGLE-3 head ships for model '{target.name}': pass one with --drafter eagle3:PATH")
    model = load_eagle3(path, dtype=DTYPES.get(dtype, torch.float32)).to(target.device)
    depth = (spec.block_size or DEFAULT_BLOCK) - 1
    budget = spec.tree_budget if spec.kind is DrafterKind.EAGLE3_TREE else 0
    return Eagle3Drafter(model, target, depth=depth, budget=budget, top_k=EAGLE3_TOP_K)


__all__ = [
    "DDTreeDrafter",
    "DFlashDrafter",
    "Drafter",
    "DrafterKind",
    "DrafterSpec",
    "ModelDrafter",
    "NgramConfig",
    "NgramDrafter",
    "build_drafter",
]
