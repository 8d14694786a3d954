"""The losslessness suite on a GPU (marker `gpu`): skipped where no CUDA device is visible, run by
benchmarks/gpu/h200.py on a lent H200.

What losslessness means there (docs/devices.md): in fp32, greedy speculative output is token-identical to plain
greedy output on the same device for every drafter; in bf16 the GPU's library kernels are not row-invariant, so
outputs may differ at near-ties: the rate is measured and reported, not asserted to be zero.
"""

from __future__ import annotations

import pytest
import torch
from test_device import drafters
from tiny import make_target

from byblock import SamplingParams, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by benchmarks/gpu/h200.py)"),
]

PROMPTS = ("def add(a, b):\n    return a + b\ndef add(a, b):", "The quick brown fox jumps over the lazy dog. The")


def cuda_target(dtype: torch.dtype = torch.float32):
    target = make_target("llama")
    target.hf.to("cuda", dtype)
    from byblock.models.adapter import TargetModel

    return TargetModel(target.hf, target.tokenizer, name="tiny-llama-cuda")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fp32_greedy_speculative_equals_plain_on_cuda(prompt):
    target = cuda_target()
    ids = target.encode_prompt(prompt, chat=False)
    params = SamplingParams(max_new_tokens=24)
    plain = generate(target, ids, params)
    for name, drafter in drafters(target).items():
        assert generate(target, ids, params, drafter=drafter).token_ids == plain.token_ids, name


def test_sampling_runs_on_the_device_generator():
    target = cuda_target()
    ids = target.encode_prompt(PROMPTS[0], chat=False)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    a, b = generate(target, ids, params), generate(target, ids, params)
    assert a.token_ids == b.token_ids  # seeded on the device: reproducible per device


def test_bf16_near_tie_divergence_rate_is_reported(capsys):
    target = cuda_target(torch.bfloat16)
    params = SamplingParams(max_new_tokens=32)
    differing, total = 0, 0
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt, chat=False)
        plain = generate(target, ids, params).token_ids
        for drafter in drafters(target).values():
            spec = generate(target, ids, params, drafter=drafter).token_ids
            total += 1
            differing += spec != plain
    with capsys.disabled():
        print(f"\nbf16 on {torch.cuda.get_device_name()}: {differing} of {total} speculative runs differ from plain")
    assert total > 0
