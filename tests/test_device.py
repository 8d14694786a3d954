"""Device is a parameter: every tensor of a round is built on the model's device (or, for host metadata, on an
explicitly named CPU), never on torch's default device.

The check: run whole requests with torch's default device set to "meta" while the model lives on the CPU. A
factory call that names no device then makes a meta tensor, and the first op mixing it with a real tensor (or
reading its values) fails loudly. Passing here on CPU is what lets the same code run on CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny import make_dflash, make_target

from byblock import SamplingParams, generate
from byblock.drafters.adaptive import AdaptiveDrafter, CostModel
from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.domino import DominoConfig, DominoDrafter, DominoHead
from byblock.drafters.draft_model import ModelDrafter
from byblock.drafters.hybrid import HybridDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.errors import ByblockError
from byblock.models.devices import resolve_device, resolve_dtype


@contextlib.contextmanager
def default_device_meta():
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def drafters(target) -> dict:
    """One of every drafter byblock ships, over the tiny target (DFlash-based ones over a restricted vocab)."""
    vocab = torch.arange(0, target.vocab_size, 2)

    def dflash(block: int = 5) -> DFlashDrafter:
        return DFlashDrafter(make_dflash(target, block=block), target, draft_vocab=vocab)

    torch.manual_seed(0)
    head = DominoHead(DominoConfig(target.hidden_size, len(vocab), gru_hidden_dim=16, emb_dim=16))
    with torch.no_grad():
        head.proj_out.weight.normal_(0, 0.5)  # a non-zero correction, so Domino's own path runs
    flat = CostModel({1: 1.0, 64: 1.2})  # drafting pays: the adaptive drafters build real drafts
    return {
        "ngram": NgramDrafter(NgramConfig(block_size=4)),
        "ngram-tree": NgramDrafter(NgramConfig(block_size=4, num_candidates=3, tree_budget=8)),
        "model": ModelDrafter(target, target_vocab=target.vocab_size, block_size=3),
        "dflash": dflash(),
        "ddtree": DDTreeDrafter(dflash(), budget=8),
        "domino": DominoDrafter(dflash(), head),
        "dominotree": DominoDrafter(dflash(), head, tree_budget=8),
        "hybrid": HybridDrafter(NgramDrafter(NgramConfig(block_size=4)), DDTreeDrafter(dflash(), budget=8), budget=10),
        "adaptive": AdaptiveDrafter(dflash(8), target, cost=flat),
        "adaptive-tree": AdaptiveDrafter(dflash(8), target, tree=True, max_budget=8, cost=flat),
        "adaptive-hybrid": AdaptiveDrafter(
            dflash(8), target, tree=True, max_budget=8, cost=flat, lookup=NgramDrafter(NgramConfig(block_size=7))
        ),
    }


@pytest.fixture(scope="module")
def llama():
    return make_target("llama")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_round_builds_its_tensors_on_the_model_device(llama, temperature):
    prompt = llama.encode_prompt("def add(a, b):\n    return a + b\ndef add(a, b):", chat=False)
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=3)
    plain = generate(llama, prompt, params)
    with default_device_meta():
        assert generate(llama, prompt, params).token_ids == plain.token_ids
    for name, drafter in drafters(llama).items():
        reference = generate(llama, prompt, params, drafter=drafter)
        with default_device_meta():
            try:
                res = generate(llama, prompt, params, drafter=drafter)
            except (RuntimeError, NotImplementedError) as e:
                pytest.fail(f"{name}: a tensor was built off the model's device: {str(e).splitlines()[0]}")
        # Same draws: nothing left the model's generator. (Adaptive drafters size drafts by the clock, so their
        # sampled runs consume the generator differently from run to run; they are checked greedy only.)
        if temperature == 0 or not name.startswith("adaptive"):
            assert res.token_ids == reference.token_ids, name
        if temperature == 0:
            assert res.token_ids == plain.token_ids, name


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param({"arch": "gemma3"}, id="sliding-window"),
        pytest.param({"packed": True}, id="packed-fp32"),
        pytest.param({"dtype": torch.bfloat16, "row_invariant": True}, id="bf16-row-invariant"),
    ],
)
def test_kernels_and_masks_build_on_the_model_device(setup):
    target = make_target(setup.get("arch", "llama"), **{k: v for k, v in setup.items() if k != "arch"})
    prompt = target.encode_prompt("for i in range(10):\n    print(i * i)\nfor i in", chat=False)
    params = SamplingParams(max_new_tokens=12)
    drafter = DDTreeDrafter(DFlashDrafter(make_dflash(target, block=5), target), budget=8)
    plain = generate(target, prompt, params)
    with default_device_meta():
        assert generate(target, prompt, params).token_ids == plain.token_ids
        assert generate(target, prompt, params, drafter=drafter).token_ids == plain.token_ids


@pytest.mark.parametrize("kv", ["int8", "window", "snapkv", "h2o"])
def test_kv_policies_build_on_the_model_device(kv):
    from byblock.kv.h2o import H2OConfig, enable_h2o
    from byblock.kv.kv_cache import StreamingWindow
    from byblock.kv.snapkv import SnapKVConfig, enable_snapkv_on

    target = make_target("llama")
    if kv == "int8":
        target.kv_bits = 8
    elif kv == "window":
        target.kv_window = StreamingWindow(sinks=2, window=12)
    elif kv == "snapkv":
        enable_snapkv_on(target, SnapKVConfig(budget=8, window=4))
    else:
        target.h2o = enable_h2o(target.hf, H2OConfig(heavy=6, recent=6))
    prompt = target.encode_prompt("The quick brown fox jumps over the lazy dog. The quick brown fox", chat=False)
    params = SamplingParams(max_new_tokens=12)
    plain = generate(target, prompt, params)
    with default_device_meta():
        assert generate(target, prompt, params).token_ids == plain.token_ids
        drafter = NgramDrafter(NgramConfig(block_size=4, num_candidates=2, tree_budget=6))
        assert generate(target, prompt, params, drafter=drafter).token_ids == plain.token_ids


def test_device_resolution():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ByblockError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ByblockError, match="no CUDA device"):
            resolve_device("cuda")
        with pytest.raises(ByblockError, match="no CUDA device"):
            resolve_device("cuda:1")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ByblockError, match="dtype"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi", "--device", "cuda"],
        ["bench", "--no-plots", "--device", "cuda:0"],
        ["serve", "--device", "cuda"],
        ["train", "dflash", "--out", "unused", "--device", "cuda"],
        ["generate", "hi", "--device", "npu"],
    ],
)
def test_a_device_this_machine_lacks_is_one_line(argv, tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "byblock.cli.main", *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "device" in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_cpu_load_keeps_the_cpu_kernels(tiny_llama_dir):
    from byblock.kernels.packed_gemm import PackedLinear, load_kernel
    from byblock.models.loading import load_model

    model = load_model(str(tiny_llama_dir), device="cpu")
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    if load_kernel() is not None:  # the packed GEMM is chosen on the CPU, as before
        assert any(isinstance(m, PackedLinear) for m in model.hf.modules())
