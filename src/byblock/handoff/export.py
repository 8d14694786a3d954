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
    LLAMACPP = "llamacpp"


@dataclass(frozen=True)
class Exported:
    """What an export wrote, and what the engine needs beside it."""

    out: Path
    format: EngineFormat
    target: str  # what the engine opens as the target: vLLM an HF directory, llama.cpp a GGUF file
    block_size: int  # the drafter's block: vLLM's num_speculative_tokens is block_size - 1
    method: str = "dflash"  # vLLM's speculative method for it


def target_gguf_of(target: str, explicit: str | None = None) -> Path:
    """The target's GGUF for llama.cpp: --target-gguf, else a built-in's shipped file, else a .gguf target."""
    from byblock.models.registry import BUILTIN_MODELS, resolve_builtin

    if explicit:
        return Path(explicit).expanduser()
    if target in BUILTIN_MODELS:
        return resolve_builtin(target)
    if target.endswith(".gguf"):
        return Path(target).expanduser()
    raise ByblockError(f"llama.cpp needs the target as GGUF: pass --target-gguf for '{target}'")


def dflash_source(model: str | None, target: str) -> Path:
    """The DFlash checkpoint to export: `model` (a path) or the one shipped for `target`; a one-line error when
    it is not a checkpoint."""
    from byblock.drafters import shipped_dflash_dir
    from byblock.drafters.dflash_format import WEIGHTS

    src = Path(model).expanduser() if model else shipped_dflash_dir(target)
    if not (src / "config.json").is_file() or not (src / WEIGHTS).is_file():
        raise ByblockError(f"{src} is not a DFlash checkpoint (needs config.json and {WEIGHTS})")
    return src


def export_drafter(drafter: str, target: str, fmt: EngineFormat, out: Path, target_gguf: str | None = None) -> Exported:
    """Write `drafter` (dflash[:PATH]) for `fmt` into `out` (replaced atomically; for llama.cpp a .gguf file,
    or DIR/dflash-draft.gguf when `out` is not one)."""
    from byblock.drafters import DrafterKind, DrafterSpec
    from byblock.models.loading import load_model, resolve_checkpoint

    spec = DrafterSpec.parse(drafter)
    if spec.kind in (DrafterKind.EAGLE3, DrafterKind.EAGLE3_TREE):
        return _export_eagle3(spec, target, fmt, out, target_gguf)
    if spec.kind is not DrafterKind.DFLASH:
        raise ByblockError(f"export takes a DFlash or EAGLE-3 drafter (dflash|eagle3[:PATH]), not '{drafter}'")
    src = dflash_source(spec.model, target)
    model = load_model(target, device="cpu", relayout=False, row_invariant=False)
    head = model.hf.get_output_embeddings().weight.detach()
    if fmt is EngineFormat.VLLM:
        from byblock.handoff.vllm import export_vllm

        written = export_vllm(src, out, head)
        engine_target = resolve_checkpoint(target)
    elif fmt is EngineFormat.LLAMACPP:
        from byblock.handoff.llamacpp import export_llamacpp

        gguf = target_gguf_of(target, target_gguf)
        written = export_llamacpp(src, out if out.suffix == ".gguf" else out / "dflash-draft.gguf", head, gguf)
        engine_target = str(gguf)
    else:  # pragma: no cover - every enum member has a branch
        raise ByblockError(f"no exporter for {fmt.value}")
    block = int(json.loads((src / "config.json").read_text()).get("block_size", 16))
    return Exported(written, fmt, engine_target, block)


def eagle3_source(model: str | None, target: str) -> Path:
    """The EAGLE-3 checkpoint to export: `model` (a path) or the one shipped for `target`."""
    from byblock.drafters import SHIPPED_EAGLE3
    from byblock.drafters.eagle3_format import is_eagle3_checkpoint

    if model:
        src = Path(model).expanduser()
    else:
        sub = SHIPPED_EAGLE3.get(target)
        src = Path(__file__).parents[1] / "drafters" / "weights" / sub if sub else Path("<none>")
        if not sub or not src.is_dir():
            raise ByblockError(f"no EAGLE-3 head ships for model '{target}': pass one with --drafter eagle3:PATH")
    if not is_eagle3_checkpoint(src):
        raise ByblockError(f"{src} is not an EAGLE-3 checkpoint (config.json of a LlamaForCausalLMEagle3)")
    return src


def _export_eagle3(spec, target: str, fmt: EngineFormat, out: Path, target_gguf: str | None = None) -> Exported:
    """An EAGLE-3 head for vLLM (byblock already writes vLLM's layout, so this re-saves it atomically, in its own
    dtype, with the round depth recorded) or as llama.cpp's `eagle3` GGUF (a .gguf file, or DIR/eagle3-draft.gguf)."""
    import torch
    from safetensors import safe_open

    from byblock.drafters import DEFAULT_BLOCK
    from byblock.drafters.dflash_format import WEIGHTS
    from byblock.drafters.eagle3_format import load_eagle3, save_eagle3
    from byblock.models.loading import resolve_checkpoint

    src = eagle3_source(spec.model, target)
    block = spec.block_size or DEFAULT_BLOCK
    if fmt is EngineFormat.LLAMACPP:
        from byblock.handoff.llamacpp import export_llamacpp_eagle3

        if (vocab := json.loads((src / "config.json").read_text()).get("vocab_size")) != _target_vocab(target):
            raise ByblockError(f"{src} was trained for a {vocab}-token vocabulary, not {target}'s")
        gguf = target_gguf_of(target, target_gguf)
        written = export_llamacpp_eagle3(src, out if out.suffix == ".gguf" else out / "eagle3-draft.gguf", gguf, block)
        return Exported(written, fmt, str(gguf), block, method="eagle3")
    with safe_open(str(src / WEIGHTS), "pt") as f:
        dtype = f.get_tensor("fc.weight").dtype
    model = load_eagle3(src, dtype=torch.float32)
    if model.config.vocab_size != _target_vocab(target):
        raise ByblockError(f"{src} was trained for a {model.config.vocab_size}-token vocabulary, not {target}'s")
    model.config.extra["num_speculative_tokens"] = block - 1
    written = save_eagle3(model, out, dtype)
    return Exported(written, fmt, resolve_checkpoint(target), block, method="eagle3")


def _target_vocab(target: str) -> int:
    from byblock.models.loading import load_model_config

    return int(load_model_config(target).get_text_config().vocab_size)
