"""int8 / int4 KV cache: round-trip error, memory, and exact composition with speculative decoding."""

from __future__ import annotations

import pytest
import torch
from tiny import make_dflash, make_target

from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.kv.kv_cache import KVCache
from byblock.kv.kv_quant import dequantize, quantize
from byblock.sampling.params import SamplingParams


@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_within_half_a_step(bits):
    x = torch.randn(2, 3, 17, 64) * torch.rand(2, 3, 17, 1) * 5
    codes, scale = quantize(x, bits)
    assert codes.dtype == torch.int8 and codes.shape[-1] == (64 if bits == 8 else 32)
    back = dequantize(codes, scale, bits, torch.float32)
    assert ((back - x).abs() <= scale / 2 + 1e-6).all()


def test_quantized_cache_is_smaller_and_crops():
    k = torch.randn(1, 2, 100, 64)
    sizes = {}
    for bits in (None, 8, 4):
        cache = KVCache(bits)
        cache.hf.update(k, k, 0)
        cache.crop(60)
        assert cache.length == 60
        sizes[bits] = cache.nbytes()
    assert sizes[8] < 0.3 * sizes[None] and sizes[4] < 0.17 * sizes[None]


@pytest.mark.parametrize("bits", [8, 4])
def test_speculative_decoding_is_lossless_over_a_quantized_cache(tiny_target, bits):
    tiny_target.kv_bits = bits
    try:
        params = SamplingParams(max_new_tokens=24)
        prompt = "The quick brown fox"
        plain = generate(tiny_target, prompt, params)
        cache = tiny_target.new_cache()  # the engine's caches really are quantized, and it shows in the logits
        ids = torch.tensor([plain.token_ids[:12]])
        quant_logits = tiny_target.forward(ids, cache).logits
        assert type(cache.hf.layers[0]).__name__ == "QuantizedLayer"
        full = make_target(tiny_target.name.removeprefix("tiny-"))
        assert not torch.equal(full.forward(ids, full.new_cache()).logits, quant_logits)
        for drafter in (
            NgramDrafter(NgramConfig(block_size=4)),
            DFlashDrafter(make_dflash(tiny_target, 4), tiny_target),
        ):
            assert generate(tiny_target, prompt, params, drafter=drafter).token_ids == plain.token_ids
    finally:
        tiny_target.kv_bits = None
