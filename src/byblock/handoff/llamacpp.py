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

An EAGLE-3 head as the GGUF `--spec-type draft-eagle3` loads (arch `eagle3`; read from `conversion/llama.py`,
`gguf-py/gguf/constants.py`, `src/models/eagle3.cpp` and `common/speculative.cpp` at the same commit):

- metadata `eagle3.*`: Llama hyperparameters (one block), `eagle3.target_layers` = byblock's ids + 1 (llama.cpp
  reads the *inputs* of those target layers, as vLLM's aux ids), `eagle3.target_hidden_size`,
  `norm_before_residual` / `norm_before_fc` false (byblock's head, like SpecForge's, has neither);
- q / k weights permuted to llama.cpp's interleaved RoPE (its EAGLE3 arch ropes as LLAMA does: the converter's
  LlamaModel.permute), every other weight as it is: `fc`, `blk.0.attn_norm` (input_layernorm, on the token
  embedding), `blk.0.attn_norm_2` (hidden_norm, on the fused features), attention and MLP, `output_norm`,
  `output` (the head over the draft vocabulary) and `d2t` as absolute target ids (int64; byblock keeps offsets);
- no token embedding (llama.cpp borrows the target's), the target's tokenizer keys.
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


class _GGUFFile:
    """A GGUFWriter on a temporary file beside `out`, renamed onto it only when the body finished."""

    def __init__(self, out: Path, arch: str) -> None:
        from gguf import GGUFWriter

        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-", suffix=".gguf")
        os.close(fd)
        self.out, self.tmp = out, Path(tmp_name)
        self.writer = GGUFWriter(str(self.tmp), arch)

    def __enter__(self):
        return self.writer

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        w = self.writer
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            self.tmp.chmod(0o644)
            self.tmp.replace(self.out)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise


def _llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half q / k rows -> llama.cpp's interleaved pairs (what its converter does for LLAMA-style ropes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


EAGLE3_LAYER = {
    "input_layernorm": "attn_norm",
    "hidden_norm": "attn_norm_2",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def eagle3_tensors(model) -> dict[str, torch.Tensor]:
    """An Eagle3DraftModel's weights under llama.cpp's names (float32; q / k permuted; d2t absolute int64)."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        if name.startswith("midlayer."):
            stem = name.removeprefix("midlayer.").removesuffix(".weight")
            if stem not in EAGLE3_LAYER:
                raise ByblockError(f"no llama.cpp name for EAGLE-3 tensor '{name}'")
            value = value.float()
            if stem == "self_attn.q_proj":
                value = _llama_permute(value, cfg.num_heads)
            elif stem == "self_attn.k_proj":
                value = _llama_permute(value, cfg.num_kv_heads)
            out[f"blk.0.{EAGLE3_LAYER[stem]}.weight"] = value
        else:
            top = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
            if name not in top:
                raise ByblockError(f"no llama.cpp name for EAGLE-3 tensor '{name}'")
            out[top[name]] = value.float()
    out["d2t"] = model.draft_vocab().to(torch.int64)  # absolute target ids: llama.cpp scatters with set_rows
    return {k: v.contiguous() for k, v in out.items()}


BLOCK_KEY = "byblock.block_size"  # an EAGLE-3 GGUF's round depth + 1, for `byblock launch` (llama.cpp ignores it)


def export_llamacpp_eagle3(src: Path, out: Path, target_gguf: Path, block_size: int) -> Path:
    """Write `src` (an EAGLE-3 checkpoint, byblock's or SpecForge's) to the GGUF file `out`; target_gguf: the
    target's GGUF (its tokenizer is copied); block_size: drafted tokens per round + 1 (recorded for launch).
    Atomic: written beside `out`, then renamed."""
    from byblock.drafters.eagle3_format import load_eagle3

    if not target_gguf.is_file():
        raise ByblockError(f"the target's GGUF {target_gguf} is not there (llama.cpp needs its tokenizer)")
    model = load_eagle3(src, dtype=torch.float32)
    cfg = model.config
    with _GGUFFile(out, "eagle3") as w:
        w.add_type("model")
        w.add_name(src.name)
        w.add_block_count(1)
        w.add_context_length(int(cfg.max_position_embeddings))
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_rope_freq_base(float(cfg.rope_theta))
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_vocab_size(cfg.vocab_size)
        w.add_file_type(0)  # all F32
        w.add_array("eagle3.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
        w.add_uint32("eagle3.target_hidden_size", cfg.hidden_size)
        w.add_bool("eagle3.norm_before_residual", False)
        w.add_bool("eagle3.norm_before_fc", False)
        w.add_uint32(BLOCK_KEY, block_size)
        w.add_quantization_version(2)
        _copy_tokenizer(w, target_gguf)
        for name, value in sorted(eagle3_tensors(model).items()):
            w.add_tensor(name, value.numpy())
    return out


def export_llamacpp(src: Path, out: Path, target_head: torch.Tensor, target_gguf: Path) -> Path:
    """Write `src` (a byblock DFlash checkpoint) to the GGUF file `out`; target_head: the target's [V, H] output
    embedding (the reduced head is cut from it); target_gguf: the target's GGUF (its tokenizer is copied).
    Atomic: written beside `out`, then renamed."""
    from gguf import GGUFValueType
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
    with _GGUFFile(out, "dflash") as w:
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
    return out
