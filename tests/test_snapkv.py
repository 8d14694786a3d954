"""SnapKV: selection by the observation window, bounded cache, exact composition with speculative decoding."""

from __future__ import annotations

import pytest
import torch
from tiny import make_dflash, make_target

from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.kv.snapkv import SnapKVConfig, enable_snapkv, select_positions
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


def test_per_head_path_equals_the_sdpa_path():
    """The per-head path (kv/h2o.py, used on sliding-window models) is a second SnapKV implementation:
    on a model without sliding layers both must decode the same tokens with the same logits."""
    from byblock.kv.h2o import enable_h2o

    cfg = SnapKVConfig(budget=16, window=8, pool=3)
    fast, slow = make_target("qwen3"), make_target("qwen3")
    fast.snapkv = enable_snapkv(fast.hf, cfg)
    slow.h2o = enable_h2o(slow.hf, None, snap=cfg)
    ids = fast.encode_prompt(PROMPT, chat=True)
    caches = fast.new_cache(), slow.new_cache()
    for step in ([ids], [[7]], [[9, 11, 13]], [[5]]):
        outs = []
        for model, cache in zip((fast, slow), caches, strict=True):
            cache.evict()
            outs.append(model.forward(torch.tensor(step), cache).logits)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_new_tokens=32)
    assert generate(fast, PROMPT, params).token_ids == generate(slow, PROMPT, params).token_ids


def test_sliding_window_models_run_snapkv_per_head():
    from lossless import NoisyOracleDrafter

    from byblock.kv.snapkv import enable_snapkv_on

    target = make_target("gemma3")
    enable_snapkv_on(target, SnapKVConfig(budget=16, window=8, pool=3))
    assert target.snapkv is None and target.h2o is not None
    ids = target.encode_prompt(PROMPT, chat=True)
    cache = target.new_cache()
    target.forward(torch.tensor([ids]), cache)
    cache.evict()
    assert cache.length == 16 + 8 and cache.next_position == len(ids)
    params = SamplingParams(max_new_tokens=32)
    plain = generate(target, PROMPT, params)
    drafters = [NgramDrafter(NgramConfig(block_size=4)), DFlashDrafter(make_dflash(target, 5), target)]
    reference = ids + plain.token_ids
    drafters += [NoisyOracleDrafter(reference, 6, tree=True, vocab=target.vocab_size, seed=s) for s in (0, 1)]
    for drafter in drafters:
        assert generate(target, PROMPT, params, drafter=drafter).token_ids == plain.token_ids
