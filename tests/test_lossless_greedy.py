"""Greedy losslessness, property-based: any drafter, any tree, any stop condition -> plain output."""

from __future__ import annotations

import functools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lossless import NoisyOracleDrafter, greedy_outputs_match
from tiny import ARCHS, make_target

from byblock import SamplingParams, generate
from byblock.drafters import ModelDrafter, NgramConfig, NgramDrafter

# library fp32, byblock's packed fp32 GEMM, the quantized kernels on int8 activations (load_model's default) and on
# fp32 ones
LINEARS = ("library", "packed", "int8", "int4", "int8/fp32", "int4/fp32")


@functools.cache
def target(arch: str, linears: str = "library"):
    weights, _, activations = linears.partition("/")
    quantized = weights.startswith("int")
    return make_target(
        arch, packed=linears == "packed", weights=weights if quantized else None, activations=activations or "int8"
    )


@functools.cache
def reference(arch: str, prompt: tuple[int, ...], linears: str = "library") -> list[int]:
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    return list(prompt) + generate(target(arch, linears), list(prompt), params).token_ids


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    arch=st.sampled_from(ARCHS),
    linears=st.sampled_from(LINEARS),  # load_model's defaults: packed for fp32 weights, int4/int8 for GGUF ones
    prompt=st.lists(st.integers(3, 319), min_size=1, max_size=24),
    block_size=st.integers(1, 16),
    max_new=st.integers(1, 40),
    kind=st.sampled_from(["oracle-chain", "oracle-tree", "ngram-chain", "ngram-tree"]),
    ignore_eos=st.booleans(),
    stop_at=st.one_of(st.none(), st.integers(0, 39)),
    seed=st.integers(0, 10**6),
)
def test_greedy_speculative_equals_plain(arch, linears, prompt, block_size, max_new, kind, ignore_eos, stop_at, seed):
    t = target(arch, linears)
    ref = reference(arch, tuple(prompt), linears)
    stop: tuple[str, ...] = ()
    if stop_at is not None:  # a stop string taken from the text the model will actually produce
        piece = t.tokenizer.decode(ref[len(prompt) + stop_at : len(prompt) + stop_at + 2], skip_special_tokens=True)
        stop = (piece,) if piece.strip() else ()
    params = SamplingParams(max_new_tokens=max_new, stop=stop, ignore_eos=ignore_eos)
    if kind.startswith("oracle"):
        drafter = NoisyOracleDrafter(ref, block_size, tree=kind == "oracle-tree", vocab=t.vocab_size, seed=seed)
    else:
        cands = 1 if kind == "ngram-chain" else 3
        drafter = NgramDrafter(NgramConfig(block_size=block_size, num_candidates=cands, tree_budget=24))
    greedy_outputs_match(t, prompt, params, drafter)


def test_oracle_tree_accepts_long_paths():
    """The suite is not vacuous: the oracle drafter gets long acceptances through trees."""
    t = target("llama")
    prompt = [5, 17, 33, 2, 9]
    ref = reference("llama", tuple(prompt))
    _, spec = greedy_outputs_match(
        t,
        prompt,
        SamplingParams(max_new_tokens=40, ignore_eos=True),
        NoisyOracleDrafter(ref, 8, True, 320, 0),
    )
    assert spec.stats.mean_accepted > 2.0
    assert max(i for i, c in enumerate(spec.stats.accept_counts) if c) >= 6


def test_target_as_its_own_drafter_accepts_everything(tiny_target):
    """A drafter that is the target itself: τ = block size + 1 in every round."""
    block = 5
    rounds = 6
    params = SamplingParams(max_new_tokens=1 + rounds * (block + 1), ignore_eos=True)
    prompt = tiny_target.encode_prompt("def add(a, b):", chat=False)
    drafter = ModelDrafter(tiny_target, target_vocab=tiny_target.vocab_size, block_size=block)
    _, spec = greedy_outputs_match(tiny_target, prompt, params, drafter)
    assert spec.stats.rounds == rounds
    assert spec.stats.mean_accepted == block + 1


def test_ngram_tree_verification_on_repetitive_text(tiny_targets):
    """Prompt lookup finds continuations in a repetitive prompt; trees of them verify losslessly."""
    t = tiny_targets["qwen3"]
    prompt = torch.arange(3, 23).repeat(4).tolist()
    drafter = NgramDrafter(NgramConfig(block_size=6, num_candidates=4, tree_budget=16))
    greedy_outputs_match(t, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), drafter)


def test_draft_model_with_different_vocabulary_is_refused():
    import pytest

    from byblock.drafters.draft_model import check_same_vocabulary
    from byblock.errors import ByblockError

    target = make_target("llama")
    other = make_target("llama", vocab_size=300)  # a tokenizer trained to a different size
    with pytest.raises(ByblockError, match="different vocabulary"):
        check_same_vocabulary(other, target)
    check_same_vocabulary(make_target("qwen3"), target)  # same tokenizer, different architecture: fine
