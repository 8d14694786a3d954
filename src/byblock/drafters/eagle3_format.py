"""EAGLE-3 checkpoints on disk: `config.json` + `model.safetensors` in the layout SpecForge writes and vLLM loads.

vLLM (`LlamaForCausalLMEagle3` -> `llama_eagle3.py`) reads a Llama config with `num_hidden_layers: 1`,
`draft_vocab_size`, `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids` (the input of
target layer L, i.e. byblock's layer L − 1 output: ids are byblock's + 1); weights `fc`, `midlayer.*`
(renamed `layers.0.*`), `norm`, `lm_head`, `d2t` (target id = draft id + d2t) and `t2d` (ignored by vLLM,
used by SGLang). No embedding: vLLM shares the target's, as byblock does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from byblock.drafters.dflash_format import WEIGHTS, atomic_dir
from byblock.drafters.eagle3_model import Eagle3Config, Eagle3DraftModel
from byblock.errors import ByblockError

ARCHITECTURE = "LlamaForCausalLMEagle3"


def to_hf_config(cfg: Eagle3Config, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The config.json dict vLLM and SGLang read."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
            "use_aux_hidden_state": True,
        },
        "num_target_layers": cfg.num_target_layers,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "byblock": cfg.extra,
    }


def from_hf_config(raw: dict) -> Eagle3Config:
    """Parse an EAGLE-3 config.json (ours, SpecForge's or an exported one)."""
    try:
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ValueError("num_hidden_layers (byblock runs one-layer EAGLE-3 heads)")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not aux:
            raise KeyError("eagle_config.eagle_aux_hidden_state_layer_ids")
        layer_ids = tuple(int(i) - 1 for i in aux)
        rope = raw.get("rope_parameters") or {}
        vocab = int(raw["vocab_size"])
        return Eagle3Config(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_layer_ids=layer_ids,
            num_target_layers=int(raw.get("num_target_layers", max(layer_ids) + 4)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            extra=dict(raw.get("byblock") or {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ByblockError(f"not an EAGLE-3 config (missing or bad {e})") from None


def is_eagle3_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds an EAGLE-3 head (by its config's architecture)."""
    cfg = Path(path) / "config.json"
    return cfg.is_file() and ARCHITECTURE in (json.loads(cfg.read_text()).get("architectures") or [])


def save_eagle3(model: Eagle3DraftModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a checkpoint directory atomically; d2t / t2d keep their integer / bool types."""
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        state = {
            k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
            for k, v in model.state_dict().items()
        }
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(to_hf_config(model.config, dtype), indent=2) + "\n")
    return Path(out_dir)


def load_eagle3(path: str | Path, dtype: torch.dtype = torch.float32) -> Eagle3DraftModel:
    """Load an EAGLE-3 checkpoint directory (one-line errors for anything else)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise ByblockError(f"{path} is not an EAGLE-3 checkpoint (needs config.json and {WEIGHTS})")
    cfg = from_hf_config(json.loads((path / "config.json").read_text()))
    model = Eagle3DraftModel(cfg)
    state = load_file(str(path / WEIGHTS))
    state = {k.removeprefix("model.").replace("layers.0.", "midlayer."): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)  # a head that ships its own copy of the target's table
    if "t2d" not in state and "d2t" in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True
        state["t2d"] = t2d
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ByblockError(f"{path}: weights do not match the config (missing {missing[:3]}, extra {unexpected[:3]})")
    model.d2t.copy_(state["d2t"].long())
    model.t2d.copy_(state["t2d"].bool())
    return model.to(dtype).eval()
