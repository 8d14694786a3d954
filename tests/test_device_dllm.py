"""Issue 31, device is a parameter: every tensor the diffusion samplers build per request and per step is made
on the model's device, never on torch's default one.

Each request runs twice: normally, then with torch's default device set to "meta". A factory call that forgets
`device=` makes a meta tensor there (no data) and the run fails loudly; one that passes the model's device is
unaffected, so the tokens must be identical."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from tiny import make_diffusion_gemma, make_hf_model

from byblock.dllm import CacheMode, DllmConfig, SamplerKind
from byblock.dllm.batch import diffusion_generate_batch
from byblock.dllm.denoisers import GemmaDenoiser, MaskDenoiser, segment_mask
from byblock.dllm.generate import DllmResult, diffusion_generate
from byblock.dllm.loading import load_dllm, resolve_dllm
from byblock.dllm.sudoku import puzzle_prompt, solve_ar

MASK_SAMPLERS = [s for s in SamplerKind if s is not SamplerKind.RENOISE]


@contextmanager
def default_device_meta() -> Iterator[None]:
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def outcome(res: DllmResult) -> tuple:
    return res.token_ids, res.steps_per_block, res.finish_reason, res.commits


def same_under_meta(run: Callable[[], DllmResult]) -> DllmResult:
    """Run normally and with the default device on meta; both must decode the same tokens in the same steps."""
    ref = run()
    with default_device_meta():
        got = run()
    assert outcome(got) == outcome(ref)
    return ref


def test_the_harness_catches_a_factory_call_without_device():
    with default_device_meta():
        assert torch.zeros(2).is_meta and torch.arange(3).is_meta and torch.tensor([1]).is_meta
        assert not torch.zeros(2, device="cpu").is_meta
    assert not torch.zeros(2).is_meta  # restored


@pytest.fixture(scope="module")
def gemma() -> GemmaDenoiser:
    return GemmaDenoiser(make_diffusion_gemma(canvas=8))


@pytest.fixture(scope="module")
def llama():
    return make_hf_model("llama")


@pytest.fixture(scope="module")
def sudoku():
    return load_dllm("sudoku6-mdm")


@pytest.mark.parametrize("cache", [CacheMode.EXACT, CacheMode.NONE])
def test_renoise_ignores_the_default_device(gemma, cache):
    cfg = DllmConfig(sampler=SamplerKind.RENOISE, steps=5, max_new_tokens=20, seed=7, cache=cache)
    res = same_under_meta(lambda: diffusion_generate(gemma, [2, 10, 11, 12, 13], cfg, eos_token_ids={1}))
    assert res.token_ids and res.commits >= 1


@pytest.mark.parametrize("cache", [CacheMode.EXACT, CacheMode.NONE])
@pytest.mark.parametrize("sampler", MASK_SAMPLERS)
def test_mask_samplers_ignore_the_default_device(llama, sampler, cache):
    model = MaskDenoiser(llama, mask_token_id=llama.config.vocab_size - 1, block_size=4)
    cfg = DllmConfig(sampler=sampler, max_new_tokens=10, threshold=0.5, temperature=0.7, seed=11, cache=cache)
    res = same_under_meta(lambda: diffusion_generate(model, [5, 9, 17, 33, 2, 8], cfg))
    assert len(res.token_ids) == 10 and res.commits == 2


@pytest.mark.parametrize("cache", [CacheMode.PREFIX, CacheMode.NONE])
def test_bidirectional_model_ignores_the_default_device(llama, cache):
    model = MaskDenoiser(llama, mask_token_id=319, block_size=4, full_bidirectional=True)
    cfg = DllmConfig(sampler=SamplerKind.THRESHOLD, threshold=0.3, max_new_tokens=8, seed=2, cache=cache)
    same_under_meta(lambda: diffusion_generate(model, [5, 9, 17, 33], cfg))


@pytest.mark.parametrize("sampler", MASK_SAMPLERS)
def test_padded_batch_ignores_the_default_device(llama, sampler):
    model = MaskDenoiser(llama, mask_token_id=llama.config.vocab_size - 1, block_size=4)
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41], [7, 7, 8, 9, 10]]
    cfg = DllmConfig(sampler=sampler, max_new_tokens=8, threshold=0.5, temperature=0.7)
    ref = diffusion_generate_batch(model, prompts, cfg, [3, 4, 5])
    with default_device_meta():
        got = diffusion_generate_batch(model, prompts, cfg, [3, 4, 5])
    assert [outcome(r) for r in got] == [outcome(r) for r in ref]


def _puzzle() -> str:
    path = resolve_dllm("sudoku6-mdm") / "test_puzzles.jsonl"
    return json.loads(path.read_text().splitlines()[0])["puzzle"]


@pytest.mark.parametrize("cache", [CacheMode.EXACT, CacheMode.NONE])
@pytest.mark.parametrize("sampler", MASK_SAMPLERS)
def test_shipped_sudoku_model_ignores_the_default_device(sudoku, sampler, cache):
    puzzle = _puzzle()
    cfg = DllmConfig(sampler=sampler, max_new_tokens=len(puzzle), steps=8, seed=0, cache=cache)
    prompt = puzzle_prompt(sudoku.tokenizer, puzzle)
    res = same_under_meta(lambda: diffusion_generate(sudoku.denoiser, prompt, cfg, sudoku.eos_token_ids))
    assert len(res.token_ids) == len(puzzle)


def test_segment_mask_and_ar_solver_ignore_the_default_device(sudoku):
    ref = segment_mask([(3, False), (2, True)], torch.float32)
    with default_device_meta():
        got = segment_mask([(3, False), (2, True)], torch.float32, "cpu")
    assert torch.equal(got, ref)
    from transformers import AutoModelForCausalLM

    ar = AutoModelForCausalLM.from_pretrained(resolve_dllm("sudoku6-ar")).eval()
    puzzle = _puzzle()
    ref_answer = solve_ar(ar, sudoku.tokenizer, puzzle)
    with default_device_meta():
        assert solve_ar(ar, sudoku.tokenizer, puzzle) == ref_answer
