"""Load a diffusion LM checkpoint directory as a Denoiser (plus its tokenizer and stop tokens).

Recognised: transformers DiffusionGemma checkpoints (config model_type "diffusion_gemma"), and any causal-LM
checkpoint with a `byblock_dllm.json` beside it ({"mask_token_id": int, "block_size": int}) — the format
`byblock train dllm` exports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from byblock.dllm.denoisers import Denoiser, GemmaDenoiser, MaskDenoiser
from byblock.errors import ByblockError, ModelNotFoundError

DLLM_CONFIG = "byblock_dllm.json"
# Diffusion checkpoints shipped inside the package (dllm/weights/<name>): `--model NAME` finds them.
SHIPPED = ("sudoku6-mdm", "sudoku6-ar")


def resolve_dllm(name_or_path: str) -> Path:
    """A shipped checkpoint name or a directory path."""
    if name_or_path in SHIPPED:
        return Path(__file__).parent / "weights" / name_or_path
    return Path(name_or_path).expanduser()


@dataclass
class LoadedDllm:
    """A diffusion model ready to decode."""

    denoiser: Denoiser
    tokenizer: object
    eos_token_ids: frozenset[int]
    meta: dict  # byblock_dllm.json (empty for DiffusionGemma)


def is_dllm_checkpoint(name_or_path: str) -> bool:
    """True for a local directory holding a diffusion model byblock can decode."""
    path = resolve_dllm(name_or_path)
    if not (path / "config.json").is_file():
        return False
    if (path / DLLM_CONFIG).is_file():
        return True
    return json.loads((path / "config.json").read_text()).get("model_type") == "diffusion_gemma"


def load_dllm(name_or_path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoadedDllm:
    """Load a diffusion checkpoint directory onto `device` (one-line errors for anything else)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from byblock.models.loading import _quiet_transformers

    _quiet_transformers()
    path = resolve_dllm(name_or_path)
    if not is_dllm_checkpoint(str(path)):
        raise ModelNotFoundError(
            f"'{name_or_path}' is not a diffusion model directory (DiffusionGemma or {DLLM_CONFIG})"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    meta: dict = {}
    if (path / DLLM_CONFIG).is_file():
        try:
            meta = json.loads((path / DLLM_CONFIG).read_text())
            mask_id, block = int(meta["mask_token_id"]), int(meta["block_size"])
        except (ValueError, KeyError, TypeError) as e:
            raise ByblockError(f"{path / DLLM_CONFIG} is malformed: {e}") from None
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
        bidi, shift = bool(meta.get("full_bidirectional", False)), bool(meta.get("shift", False))
        denoiser: Denoiser = MaskDenoiser(hf, mask_id, block, bidi, shift)
    else:
        from transformers import DiffusionGemmaForBlockDiffusion

        hf = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype).to(device)
        denoiser = GemmaDenoiser(hf)
    eos = getattr(hf.generation_config, "eos_token_id", None) or tokenizer.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    return LoadedDllm(denoiser, tokenizer, eos_ids, meta)
