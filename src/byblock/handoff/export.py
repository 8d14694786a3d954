"""One entry for every engine layout: resolve the drafter and the target, write the layout, say how to serve it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from byblock.errors import ByblockError


class EngineFormat(Enum):
    """The engines byblock hands a drafter to."""

    VLLM = "vllm"


@dataclass(frozen=True)
class Exported:
    """What an export wrote, and what the engine needs beside it."""

    out: Path
    format: EngineFormat
    target: str  # the target checkpoint the engine opens (a built-in's de-quantized HF directory)
    block_size: int  # the drafter's block: vLLM's num_speculative_tokens is block_size - 1


def export_drafter(drafter: str, target: str, fmt: EngineFormat, out: Path) -> Exported:
    """Write `drafter` (dflash[:PATH]) for `fmt` into `out` (replaced atomically)."""
    from byblock.drafters import DrafterKind, DrafterSpec, shipped_dflash_dir
    from byblock.drafters.dflash_format import WEIGHTS
    from byblock.models.loading import load_model, resolve_checkpoint

    spec = DrafterSpec.parse(drafter)
    if spec.kind is not DrafterKind.DFLASH:
        raise ByblockError(f"export takes a DFlash drafter (dflash[:PATH]), not '{drafter}'")
    src = Path(spec.model).expanduser() if spec.model else shipped_dflash_dir(target)
    if not (src / "config.json").is_file() or not (src / WEIGHTS).is_file():
        raise ByblockError(f"{src} is not a DFlash checkpoint (needs config.json and {WEIGHTS})")
    model = load_model(target, device="cpu", relayout=False, row_invariant=False)
    head = model.hf.get_output_embeddings().weight.detach()
    if fmt is EngineFormat.VLLM:
        from byblock.handoff.vllm import export_vllm

        written = export_vllm(src, out, head)
    else:  # pragma: no cover - every enum member has a branch
        raise ByblockError(f"no exporter for {fmt.value}")
    block = int(json.loads((written / "config.json").read_text()).get("block_size", 16))
    return Exported(written, fmt, resolve_checkpoint(target), block)
