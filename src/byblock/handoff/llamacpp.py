"""A DFlash drafter as the GGUF llama.cpp's `--spec-type draft-dflash` loads (arch `dflash`; read from
llama.cpp's `conversion/qwen.py::DFlashModel`, `gguf-py/gguf/constants.py` and `src/models/dflash.cpp` at the
commit llama-cpp-python 0.3.36 vendors, 0c1e570):

- metadata `dflash.*`: the Qwen3-style hyperparameters, `dflash.block_size`, and `dflash.target_layers` =
  target_layer_ids + 1 (llama.cpp counts the embedding output as layer 0);
- the tokenizer: the target's own `tokenizer.*` keys, copied from the target's GGUF (llama.cpp checks the two
  vocabularies match), plus `tokenizer.ggml.mask_token_id`;
- tensors: `fc`, `enc.output_norm` (DFlash's hidden_norm), `output_norm`, `blk.N.*` in llama.cpp's names; no
  embeddings (shared with the target at run time);
- a restricted draft vocabulary: `d2t` as absolute target ids (int64; dflash.cpp scatters draft logit i to
  row d2t[i] with set_rows — vLLM's offsets would be wrong here) and a reduced head `output.weight`;
- Domino's correction head has no llama.cpp counterpart and stays out.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from byblock.errors import ByblockError

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}


def gguf_tensor_name(name: str) -> str:
    """byblock's DFlash tensor name → llama.cpp's."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4:
        stem, suffix = ".".join(parts[2:-1]), parts[-1]
        if stem in LAYER_NAMES:
            return f"blk.{parts[1]}.{LAYER_NAMES[stem]}.{suffix}"
    raise ByblockError(f"no llama.cpp name for DFlash tensor '{name}'")


def _copy_tokenizer(writer, target_gguf: Path) -> None:
    """Every `tokenizer.*` key of the target's GGUF, with its type."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(target_gguf))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)


def export_llamacpp(src: Path, out: Path, target_head: torch.Tensor, target_gguf: Path) -> Path:
    """Write `src` (a byblock DFlash checkpoint) to the GGUF file `out`; target_head: the target's [V, H] output
    embedding (the reduced head is cut from it); target_gguf: the target's GGUF (its tokenizer is copied).
    Atomic: written beside `out`, then renamed."""
    from gguf import GGUFValueType, GGUFWriter
    from safetensors.torch import load_file

    from byblock.drafters.dflash_format import VOCAB, WEIGHTS

    if not target_gguf.is_file():
        raise ByblockError(f"the target's GGUF {target_gguf} is not there (llama.cpp needs its tokenizer)")
    cfg = json.loads((src / "config.json").read_text())
    dflash = cfg.get("dflash_config", {})
    if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
        raise ByblockError(f"{src}/config.json has no dflash_config.target_layer_ids / mask_token_id")
    if target_head.shape[0] != int(cfg["vocab_size"]):
        raise ByblockError(
            f"the target's head has {target_head.shape[0]} rows; the drafter expects {cfg['vocab_size']}"
        )
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-", suffix=".gguf")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = GGUFWriter(str(tmp), "dflash")
        w.add_type("model")
        w.add_name(src.name)
        w.add_block_count(int(cfg["num_hidden_layers"]))
        w.add_context_length(int(cfg.get("max_position_embeddings", 8192)))
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
        w.add_head_count(heads)
        w.add_head_count_kv(int(cfg.get("num_key_value_heads", heads)))
        w.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
        w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_file_type(0)  # all F32
        w.add_uint32("dflash.block_size", int(dflash.get("block_size", cfg.get("block_size", 16))))
        w.add_array("dflash.target_layers", [int(i) + 1 for i in dflash["target_layer_ids"]])
        w.add_quantization_version(2)
        _copy_tokenizer(w, target_gguf)
        w.add_key_value("tokenizer.ggml.mask_token_id", int(dflash["mask_token_id"]), GGUFValueType.UINT32)
        state = load_file(str(src / WEIGHTS))
        for name in sorted(state):
            w.add_tensor(gguf_tensor_name(name), state[name].to(torch.float32).contiguous().numpy())
        if (src / VOCAB).is_file():
            ids = load_file(str(src / VOCAB))["draft_to_target"].to(torch.long)
            w.add_tensor("d2t", ids.contiguous().numpy())  # absolute target ids, int64
            w.add_tensor("output.weight", target_head[ids].to(torch.float32).contiguous().numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.chmod(0o644)
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
