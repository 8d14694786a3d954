"""SnapKV: selection by the observation window, bounded cache, exact composition with speculative decoding."""

from __future__ import annotations

import pytest
import torch
from tiny import make_dflash, make_target

from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.models.snapkv import SnapKVConfig, enable_snapkv, select_positions
from byblock.sampling.params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6 + "def add(a, b): return a + b"


def test_selection_prefers_what_the_window_attends_to():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 40, 8) * 0.1
    k = torch.randn(1, 2, 40, 8) * 0.1
    k[:, :, 5] = q[:, :, -8:].mean(2)[:, ::2] * 40  # position 5 matches the observation queries strongly
    sel = select_positions(q, k, SnapKVConfig(budget=4, window=8, pool=1), scale=1.0)
    assert sel.shape == (1, 2, 12) and (sel[..., :4] == 5).any(-1).all()
    assert (sel[..., 4:] == torch.arange(32, 40)).all()
    assert select_positions(q, k, SnapKVConfig(budget=40, window=8), 1.0) is None  # nothing to compress


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_speculative_decoding_is_lossless_over_snapkv(arch):
    target = make_target(arch)
    target.snapkv = enable_snapkv(target.hf, SnapKVConfig(budget=16, window=8, pool=3))
    params = SamplingParams(max_new_tokens=32)
    plain = generate(target, PROMPT, params)
    for drafter in (NgramDrafter(NgramConfig(block_size=4)), DFlashDrafter(make_dflash(target, 5), target)):
        assert generate(target, PROMPT, params, drafter=drafter).token_ids == plain.token_ids
    cache = target.new_cache()
    ids = target.encode_prompt(PROMPT, chat=True)
    target.forward(torch.tensor([ids]), cache)
    assert cache.length == 16 + 8 and cache.next_position == len(ids)
    compressed = target.forward(torch.tensor([[7]]), cache).logits[0, -1]
    full = make_target(arch)
    full_cache = full.new_cache()
    full.forward(torch.tensor([ids]), full_cache)
    assert not torch.allclose(full.forward(torch.tensor([[7]]), full_cache).logits[0, -1], compressed)


def test_sliding_window_models_are_refused():
    with pytest.raises(ValueError, match="sliding"):
        enable_snapkv(make_target("gemma3").hf, SnapKVConfig())
