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


# ---- EAGLE-3 heads as llama.cpp's `eagle3` GGUF ---------------------------------------------------------------


def _eagle3_export(tmp_path, tiny_targets, vocab=None):
    from tiny import make_eagle3

    from byblock.drafters.eagle3_format import save_eagle3
    from byblock.handoff.llamacpp import export_llamacpp_eagle3

    target = tiny_targets["llama"]
    model = make_eagle3(target, draft_vocab=vocab)
    src = save_eagle3(model, tmp_path / "eagle3", torch.float32)
    tgt = _tiny_target_gguf(tmp_path / "target.gguf", target.vocab_size)
    return model, export_llamacpp_eagle3(src, tmp_path / "e3.gguf", tgt, block_size=5)


def _interleaved_rope(x, pos, theta):
    """llama.cpp's LLAMA-style RoPE: adjacent pairs (2i, 2i+1) rotate by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None] * inv  # [T, d/2]
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = a * ang.sin() + b * ang.cos()
    return out


@pytest.mark.parametrize("vocab_map", [False, True])
def test_eagle3_export_writes_llama_cpps_eagle3_gguf(tmp_path, tiny_targets, vocab_map):
    vocab = torch.tensor(sorted({0, 1, 2, *range(3, 320, 3)})) if vocab_map else None
    model, out = _eagle3_export(tmp_path, tiny_targets, vocab)
    fields, tensors = _read(out)
    cfg = model.config
    assert fields["general.architecture"] == "eagle3" and fields["eagle3.block_count"] == 1
    assert fields["eagle3.target_layers"] == [i + 1 for i in cfg.target_layer_ids]  # layer inputs, as vLLM's
    assert fields["eagle3.target_hidden_size"] == cfg.hidden_size and fields["byblock.block_size"] == 5
    assert fields["eagle3.norm_before_residual"] is False and fields["eagle3.norm_before_fc"] is False
    assert fields["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    assert "token_embd.weight" not in tensors  # llama.cpp borrows the target's table
    want = {"fc.weight", "output_norm.weight", "output.weight", "d2t"}
    want |= {f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output")}
    want |= {f"blk.0.{n}.weight" for n in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(tensors) == want
    state = model.state_dict()
    same = {
        "fc.weight": "fc.weight",
        "output.weight": "lm_head.weight",
        "blk.0.attn_norm_2.weight": "midlayer.hidden_norm.weight",
    }
    for gguf_name, name in same.items():
        got = np.asarray(tensors[gguf_name].data).reshape(state[name].shape)
        assert np.array_equal(got, state[name].numpy()), gguf_name
    assert tensors["d2t"].tensor_type.name == "I64"
    assert np.asarray(tensors["d2t"].data).tolist() == model.draft_vocab().tolist()  # absolute target ids


def test_eagle3_q_k_are_permuted_to_llama_cpps_rope(tmp_path, tiny_targets):
    """Scores q·k under llama.cpp's interleaved RoPE over the exported weights equal byblock's rotate-half RoPE
    over its own: the permutation is the one the converter applies."""
    from byblock.drafters.dflash_model import apply_rope, rope_cos_sin

    model, out = _eagle3_export(tmp_path, tiny_targets)
    _, tensors = _read(out)
    cfg, state = model.config, model.state_dict()
    d, theta = cfg.head_dim, cfg.rope_theta
    x = torch.randn(6, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(3, 9).float()
    cos, sin = rope_cos_sin(pos[None], d, theta, torch.float32)
    wq, wk = state["midlayer.self_attn.q_proj.weight"], state["midlayer.self_attn.k_proj.weight"]
    gq = torch.from_numpy(np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(wq.shape).copy())
    gk = torch.from_numpy(np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(wk.shape).copy())
    assert not torch.equal(gq, wq)
    q_hf = apply_rope((x @ wq.T).view(6, cfg.num_heads, d).transpose(0, 1)[None], cos, sin)[0]
    k_hf = apply_rope((x @ wk.T).view(6, cfg.num_kv_heads, d).transpose(0, 1)[None], cos, sin)[0]
    q_ll = _interleaved_rope((x @ gq.T).view(6, cfg.num_heads, d).transpose(0, 1), pos, theta)
    k_ll = _interleaved_rope((x @ gk.T).view(6, cfg.num_kv_heads, d).transpose(0, 1), pos, theta)
    group = cfg.num_heads // cfg.num_kv_heads
    s_hf = q_hf @ k_hf.repeat_interleave(group, 0).transpose(1, 2)
    s_ll = q_ll @ k_ll.repeat_interleave(group, 0).transpose(1, 2)
    torch.testing.assert_close(s_ll, s_hf, rtol=1e-4, atol=1e-4)


def test_eagle3_export_and_launch_through_the_cli(tmp_path, tiny_targets):
    from tiny import make_eagle3

    from byblock.drafters.eagle3_format import save_eagle3

    target = tiny_targets["llama"]
    src = save_eagle3(make_eagle3(target), tmp_path / "eagle3", torch.float32)
    target.hf.save_pretrained(tmp_path / "tgt")
    target.tokenizer.save_pretrained(tmp_path / "tgt")
    tgt = _tiny_target_gguf(tmp_path / "target.gguf", target.vocab_size)
    cmd = [*CLI, "export", "--format", "llamacpp", "--target", str(tmp_path / "tgt"), "--target-gguf", str(tgt)]
    r = subprocess.run(
        [*cmd, "--drafter", f"eagle3:{src}", "--out", str(tmp_path / "out")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert (
        line["speculative_config"]["method"] == "eagle3" and line["speculative_config"]["num_speculative_tokens"] == 7
    )
    launch = [*CLI, "launch", "llamacpp", "--target", str(tmp_path / "tgt"), "--target-gguf", str(tgt)]
    r = subprocess.run([*launch, "--exported", line["out"]], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--spec-type draft-eagle3" in r.stdout and "--spec-draft-n-max 7" in r.stdout


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.skipif(not os.environ.get("BYBLOCK_LLAMA_SERVER"), reason="set BYBLOCK_LLAMA_SERVER to a llama-server")
def test_llama_server_loads_an_eagle3_export(tmp_path):
    """A random EAGLE-3 head of the default model's shape: llama-server loads it, drafts with it (τ is then ~1, so
    the check is that it runs) and stays token-identical to its own plain decoding."""
    real_model_or_skip()
    from byblock.drafters.eagle3_format import save_eagle3
    from byblock.drafters.eagle3_model import Eagle3Config, Eagle3DraftModel
    from byblock.models.loading import load_model_config

    c = load_model_config("smollm2-135m")
    heads = c.num_attention_heads
    cfg = Eagle3Config(
        hidden_size=c.hidden_size,
        intermediate_size=256,
        num_heads=heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // heads,
        vocab_size=c.vocab_size,
        draft_vocab_size=c.vocab_size,
        target_layer_ids=(1, 14, 26),
        num_target_layers=c.num_hidden_layers,
    )
    torch.manual_seed(0)
    head = save_eagle3(Eagle3DraftModel(cfg), tmp_path / "head", torch.float32)
    cmd = [*CLI, "bench", "--methods", f"llamacpp,llamacpp-eagle3:{head}@4", "--limit", "2", "--max-new-tokens", "24"]
    r = subprocess.run([*cmd, "--no-plots", "--quiet", "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["datasets"]["dev"]["methods"]
    assert rows[f"llamacpp-eagle3:{head}@4"]["mismatched_vs_engine"] == 0
