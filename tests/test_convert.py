"""AR → block diffusion (byblock train convert): trains on regenerated data, resumes bit for bit, exports a
checkpoint the dLLM samplers decode with the exact block KV cache (equal to recomputing everything)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from byblock.dllm.config import CacheMode, DllmConfig, SamplerKind
from byblock.dllm.generate import diffusion_generate
from byblock.dllm.loading import load_dllm
from byblock.training.convert import ConvertConfig, Converter

CFG = ConvertConfig(block_size=4, steps=6, seqs_per_step=2, val_examples=4, eval_every=3, ckpt_every=2, lr=1e-3)


def test_convert_trains_resumes_and_exports_a_block_diffusion_model(regen_dir, tiny_llama_dir, tmp_path):
    data = regen_dir / "regen"
    whole = Converter(str(tiny_llama_dir), data, tmp_path / "a", CFG)
    before = whole.evaluate()
    last = whole.run(progress=False)
    assert last["step"] == 6 and set(last["eval"]) == {"acc_full_mask", "acc_half_mask"}
    assert (tmp_path / "a" / "train.log").read_text().count('"eval"') >= 3  # step 0 (the AR model), 3, 6
    assert before  # the AR model as a dLLM before any step is measured
    part = Converter(str(tiny_llama_dir), data, tmp_path / "b", CFG)
    part.run(progress=False, stop_after=3)  # "killed" after a checkpoint at step 2 and a save at 3
    resumed = Converter(str(tiny_llama_dir), data, tmp_path / "b", CFG)
    assert resumed.step == 3
    resumed.run(progress=False)
    for (name, p), q in zip(whole.hf.state_dict().items(), resumed.hf.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(Exception, match="another recipe"):
        Converter(str(tiny_llama_dir), data, tmp_path / "b", ConvertConfig(block_size=8, steps=6))
    export = whole.export(tmp_path / "export")
    meta = json.loads((export / "byblock_dllm.json").read_text())
    assert meta["shift"] is True and meta["block_size"] == 4 and meta["mask_token_id"] == whole.mask_id
    loaded = load_dllm(str(export))
    prompt = loaded.tokenizer("def add(a, b):")["input_ids"]
    for sampler in (SamplerKind.LOW_CONFIDENCE, SamplerKind.THRESHOLD, SamplerKind.ENTROPY):
        outs = [
            diffusion_generate(loaded.denoiser, prompt, DllmConfig(sampler=sampler, max_new_tokens=12, cache=cache))
            for cache in (CacheMode.EXACT, CacheMode.NONE)
        ]
        assert outs[0].token_ids == outs[1].token_ids and outs[0].nfe == outs[1].nfe, sampler
        assert len(outs[0].token_ids) >= 1


def test_shifted_logits_read_the_row_before_each_canvas_token(tiny_llama_dir):
    """MaskDenoiser(shift=True): canvas logits are the AR model's next-token logits of the rows before."""
    from transformers import AutoModelForCausalLM

    from byblock.dllm.denoisers import MaskDenoiser

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="sdpa").eval()
    den = MaskDenoiser(hf, mask_token_id=0, block_size=4, shift=True)
    prompt = torch.tensor([[5, 9, 33, 71, 12]])
    canvas = torch.tensor([[0, 0, 0, 0]])
    for cache in (CacheMode.EXACT, CacheMode.NONE):
        got = den.session(prompt, cache).denoise(canvas, None)
        with torch.no_grad():
            full = hf(input_ids=torch.cat([prompt, canvas], 1)).logits  # causal rows up to the first canvas row
        torch.testing.assert_close(got[:, 0], full[:, 4].float(), rtol=1e-5, atol=1e-5)  # the prompt's last row


def test_convert_cli(regen_dir, tiny_llama_dir, tmp_path):
    base = [sys.executable, "-m", "byblock.cli.main", "train", "convert", "--model", str(tiny_llama_dir)]
    flags = ["--steps", "2", "--seqs-per-step", "1", "--block-size", "4", "--val-examples", "2", "--quiet"]
    flags += ["--bf16", "true"]
    ok = subprocess.run(
        [*base, "--data", str(regen_dir / "regen"), "--out", str(tmp_path), *flags], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["train"]["step"] == 2 and (tmp_path / "export-dllm" / "byblock_dllm.json").is_file()
    gen = subprocess.run(
        [sys.executable, "-m", "byblock.cli.main", "generate", "hello", "--model", str(tmp_path / "export-dllm"),
         "--max-new-tokens", "8", "--json"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout.strip().splitlines()[-1])["nfe"] >= 1
    for bad in (["--data", str(tmp_path / "missing"), "--out", str(tmp_path / "x")], ["--out", str(tmp_path / "y")]):
        r = subprocess.run([*base, *bad, *flags], capture_output=True, text=True)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
