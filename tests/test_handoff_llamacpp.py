"""`byblock export --format llamacpp`: the drafter as llama.cpp's `dflash` GGUF. The layout (keys, tensor names,
d2t as absolute ids) was checked once against llama.cpp's own converter at the commit llama-cpp-python 0.3.36
vendors — identical tensors (dev/LOG.md, session 22); these tests pin it. With $BYBLOCK_LLAMA_SERVER (a built
llama-server) the export also runs in llama.cpp's `--spec-type draft-dflash`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import real_model_or_skip
from tiny import make_dflash

from byblock.drafters.dflash_format import save_dflash
from byblock.errors import ByblockError
from byblock.handoff.llamacpp import export_llamacpp, gguf_tensor_name

CLI = [sys.executable, "-m", "byblock.cli.main"]


def _tiny_target_gguf(path, vocab: int):
    """A GGUF holding only a tokenizer (what the exporter copies from the target's file)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _read(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in r.tensors}


def test_tensor_names_follow_llama_cpp():
    assert gguf_tensor_name("hidden_norm.weight") == "enc.output_norm.weight"
    assert gguf_tensor_name("layers.2.self_attn.o_proj.weight") == "blk.2.attn_output.weight"
    assert gguf_tensor_name("layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    with pytest.raises(ByblockError, match=r"no llama\.cpp name"):
        gguf_tensor_name("prefix_gru.weight_ih")  # Domino's head is not exported


@pytest.mark.parametrize("vocab_map", [False, True])
def test_export_writes_the_dflash_gguf(tmp_path, tiny_targets, vocab_map):
    target = tiny_targets["llama"]
    drafter = make_dflash(target, block=4)
    ids = torch.tensor([0, 2, 3, 5, 7, 11]) if vocab_map else None
    src = save_dflash(drafter, tmp_path / "dflash", torch.float32, draft_vocab=ids)
    head = target.hf.get_output_embeddings().weight.detach()
    tgt = _tiny_target_gguf(tmp_path / "target.gguf", head.shape[0])
    out = export_llamacpp(src, tmp_path / "draft.gguf", head, tgt)
    fields, tensors = _read(out)
    cfg = json.loads((src / "config.json").read_text())
    assert fields["general.architecture"] == "dflash" and fields["dflash.block_size"] == 4
    assert fields["dflash.target_layers"] == [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]]
    assert fields["tokenizer.ggml.mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    assert fields["tokenizer.ggml.tokens"][:2] == ["t0", "t1"] and fields["tokenizer.ggml.eos_token_id"] == 2
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    for name, value in state.items():
        t = tensors[gguf_tensor_name(name)]
        assert np.array_equal(np.asarray(t.data).reshape(value.shape), value.numpy()), name
    assert ("d2t" in tensors) == vocab_map
    if vocab_map:  # absolute target ids (llama.cpp scatters with set_rows), the head cut at them
        assert np.asarray(tensors["d2t"].data).tolist() == ids.tolist()
        rows = np.asarray(tensors["output.weight"].data).reshape(len(ids), -1)
        assert np.array_equal(rows, head[ids].numpy())


def test_export_needs_the_target_gguf(tmp_path, tiny_targets):
    target = tiny_targets["llama"]
    src = save_dflash(make_dflash(target, block=4), tmp_path / "dflash", torch.float32)
    head = target.hf.get_output_embeddings().weight.detach()
    with pytest.raises(ByblockError, match="GGUF"):
        export_llamacpp(src, tmp_path / "d.gguf", head, tmp_path / "missing.gguf")
    r = subprocess.run(
        [*CLI, "export", "--format", "llamacpp", "--target", str(tmp_path), "--drafter", f"dflash:{src}"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.real_model
def test_shipped_drafter_exports_with_its_draft_vocabulary(tmp_path):
    real_model_or_skip()
    r = subprocess.run(
        [*CLI, "export", "--format", "llamacpp", "--out", str(tmp_path / "x")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    fields, tensors = _read(line["out"])
    assert fields["tokenizer.ggml.pre"] == "smollm" and len(fields["tokenizer.ggml.tokens"]) == 49152
    assert tensors["d2t"].tensor_type.name == "I64" and len(np.asarray(tensors["d2t"].data)) == 8192


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(not os.environ.get("BYBLOCK_LLAMA_SERVER"), reason="set BYBLOCK_LLAMA_SERVER to a llama-server")
def test_llama_server_drafts_with_the_export(tmp_path):
    real_model_or_skip()
    cmd = [*CLI, "bench", "--methods", "ar,llamacpp,llamacpp-dflash,llamacpp-lookup", "--limit", "2"]
    cmd += ["--max-new-tokens", "32"]
    cmd += ["--no-plots", "--quiet", "--out", str(tmp_path / "out")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["datasets"]["dev"]["methods"]
    assert rows["llamacpp-dflash"]["tau"] > 1.2  # it loaded the drafter and accepted its tokens
    # llama.cpp's drafting is lossless against its own plain decoding
    assert rows["llamacpp-lookup"]["mismatched_vs_engine"] == rows["llamacpp-dflash"]["mismatched_vs_engine"] == 0
