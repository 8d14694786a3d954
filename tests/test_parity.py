"""byblock's plain decoder is token-identical to transformers' own generate (the ground truth)."""

from __future__ import annotations

import pytest
import torch
from conftest import real_model_or_skip

from byblock import SamplingParams, generate

PROMPTS = ["def add(a, b):", "The quick brown fox", "Question: what is 12 plus 30?"]


def hf_greedy(target, ids: list[int], n: int) -> list[int]:
    out = target.hf.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(target.eos_token_ids)
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_hf_generate(tiny_target, prompt):
    ids = tiny_target.encode_prompt(prompt, chat=True)
    n = 40  # > gemma3's sliding window of 8, so the window is exercised
    ours = generate(tiny_target, ids, SamplingParams(max_new_tokens=n)).token_ids
    assert ours == hf_greedy(tiny_target, ids, n)


@pytest.mark.real_model
def test_default_model_matches_hf_generate():
    target = real_model_or_skip()
    for prompt in ["Write a haiku about GPUs", "What is 7 times 8?"]:
        ids = target.encode_prompt(prompt, chat=True)
        ours = generate(target, ids, SamplingParams(max_new_tokens=24)).token_ids
        assert ours == hf_greedy(target, ids, 24)


def test_relayout_linear_matches_nn_linear():
    from byblock.kernels.fast_linear import InOutLinear

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 96, bias=True)
    fast = InOutLinear(lin)
    for m in (1, 3, 17):
        x = torch.randn(2, m, 48)
        torch.testing.assert_close(fast(x), lin(x), atol=1e-5, rtol=1e-5)
    assert fast.weight.shape == lin.weight.shape


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_relayout_model_greedy_unchanged(arch):
    """The re-laid-out model decodes the same tokens as the original on the tiny models."""
    from tiny import make_target

    from byblock.kernels.fast_linear import relayout_linears

    target = make_target(arch)
    ids = target.encode_prompt("def add(a, b):", chat=True)
    before = generate(target, ids, SamplingParams(max_new_tokens=30)).token_ids
    assert relayout_linears(target.hf) > 0
    assert generate(target, ids, SamplingParams(max_new_tokens=30)).token_ids == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dual_layout_linear_matches_nn_linear_in_both_regimes(dtype):
    from byblock.kernels.fast_linear import DualLayoutLinear, dual_layout_linears

    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 96, bias=True).to(dtype)
    fast = DualLayoutLinear(lin, min_rows=4, rows_use_t=dtype == torch.bfloat16)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for m in (1, 3, 4, 17):  # below and above the row threshold: both kernels
        x = torch.randn(1, m, 48, dtype=dtype)
        torch.testing.assert_close(fast(x), lin(x), atol=tol, rtol=tol)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    assert dual_layout_linears(model) == 2 and fast.weight.shape == lin.weight.shape


def test_dual_layout_model_greedy_unchanged():
    from tiny import make_target

    from byblock.kernels.fast_linear import dual_layout_linears

    target = make_target("qwen3")
    ids = target.encode_prompt("def add(a, b):", chat=True)
    before = generate(target, ids, SamplingParams(max_new_tokens=30)).token_ids
    assert dual_layout_linears(target.hf) > 0
    assert generate(target, ids, SamplingParams(max_new_tokens=30)).token_ids == before
