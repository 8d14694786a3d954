"""DFlash checkpoints on disk: `config.json` + `model.safetensors`, the reference layout.

What the reference (`dflash` 0.1.0 `DFlashDraftModel.from_pretrained`), vLLM (`method: "dflash"`) and SGLang
(`--speculative-algorithm DFLASH`) read: a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `dflash_config: {mask_token_id, target_layer_ids}`; weights
`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
`layers.{i}.{input,post_attention}_layernorm`, `norm`, `fc`, `hidden_norm` — no embedding, no LM head.

byblock adds an optional `draft_vocab.safetensors` (the target token ids the drafter may propose, in the
`d2t` convention of vLLM: target_id = draft_id + d2t[draft_id]); other loaders ignore the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from byblock.drafters.dflash_model import DFlashConfig, DFlashDraftModel
from byblock.errors import ByblockError

WEIGHTS = "model.safetensors"
VOCAB = "draft_vocab.safetensors"


def to_hf_config(cfg: DFlashConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config.json dict in the reference layout."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "layer_types": ["sliding_attention" if cfg.sliding_window else "full_attention"] * cfg.num_layers,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            # Block rows see each other (DFlash's drafter is non-causal). Said explicitly for windowed drafters:
            # vLLM's qwen3_dflash.py makes a layer listed as "sliding_attention" causal unless told otherwise.
            **({"use_swa": True, "swa_window_size": cfg.sliding_window, "causal": False} if cfg.sliding_window else {}),
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
        "byblock": cfg.extra,
    }


def from_hf_config(raw: dict) -> DFlashConfig:
    """Parse a reference-layout config.json (dflash_config keys win over top-level ones, as in the reference)."""
    dcfg = raw.get("dflash_config") or {}

    def pick(name: str, default=None):
        return dcfg.get(name, raw.get(name, default))

    try:
        num_layers = int(raw["num_hidden_layers"])
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        rope = raw.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            from byblock.training.regenerate import build_target_layer_ids

            layer_ids = build_target_layer_ids(int(raw["num_target_layers"]), num_layers)
        mask_id = pick("mask_token_id")
        if mask_id is None:
            raise KeyError("dflash_config.mask_token_id")
        return DFlashConfig(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=int(raw.get("num_target_layers", max(layer_ids) + 1)),
            vocab_size=int(raw.get("vocab_size", 0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            sliding_window=_window(dcfg, raw),
            extra=dict(raw.get("byblock") or {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ByblockError(f"not a DFlash config (missing or bad {e})") from None


def _window(dcfg: dict, raw: dict) -> int | None:
    """The drafter's sliding window: dflash_config.use_swa / swa_window_size (vLLM's qwen3_dflash.py), else the
    top-level use_sliding_window / sliding_window of sliding layers; None: full attention."""
    if dcfg.get("use_swa"):
        return int(dcfg.get("swa_window_size") or raw["sliding_window"])
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        return int(raw["sliding_window"])
    return None


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """A temporary directory beside `out_dir` to write a checkpoint into; renamed into place (replacing any
    old one) when the block ends, removed if it raises: a reader never sees half a checkpoint."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes 0700; a checkpoint is meant to be shared
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_dflash(
    model: DFlashDraftModel,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    draft_vocab: torch.Tensor | None = None,
) -> Path:
    """Write a checkpoint directory atomically (temporary directory renamed into place)."""
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(to_hf_config(model.config, dtype), indent=2) + "\n")
        if draft_vocab is not None:
            ids = draft_vocab.to(torch.long)
            d2t = ids - torch.arange(len(ids))
            save_file({"draft_to_target": ids, "d2t": d2t}, str(tmp / VOCAB))
    return Path(out_dir)


def load_dflash(
    path: str | Path, dtype: torch.dtype | None = torch.float32
) -> tuple[DFlashDraftModel, torch.Tensor | None]:
    """Load a reference-layout checkpoint; returns the model and byblock's draft vocabulary (or None).
    `dtype` None: the file's own dtype, its tensors mapped from the file (read lazily, copied on write)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise ByblockError(f"{path} is not a DFlash checkpoint (needs config.json and {WEIGHTS})")
    raw = json.loads((path / "config.json").read_text())
    cfg = from_hf_config(raw)
    with torch.device("meta"):  # no random init and no second copy: the parameters become the file's tensors
        model = DFlashDraftModel(cfg)
    state = load_file(str(path / WEIGHTS))  # a private (copy-on-write) mapping of the file: writable, lazily read
    state = {k.removeprefix("model."): v for k, v in state.items()}  # vLLM-style prefixed exports load too
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ByblockError(f"{path}: weights do not match the config (missing {missing[:3]}, extra {unexpected[:3]})")
    vocab = None
    if (path / VOCAB).is_file():
        vocab = load_file(str(path / VOCAB))["draft_to_target"].to(torch.long)
    return (model if dtype is None else model.to(dtype)).eval(), vocab
