"""StreamingLLM windows: the cache stays bounded, and speculative decoding over it is exactly lossless."""

from __future__ import annotations

import pytest
import torch
from tiny import make_dflash

from byblock.drafters.ddtree import DDTreeDrafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.kv.kv_cache import StreamingWindow
from byblock.sampling.params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"


def test_window_changes_the_model_and_bounds_the_cache(tiny_target):
    params = SamplingParams(max_new_tokens=40)
    tiny_target.kv_window = StreamingWindow(sinks=2, window=8)
    try:
        cache = tiny_target.new_cache()
        ids = tiny_target.encode_prompt(PROMPT, chat=True)
        windowed = tiny_target.forward(torch.tensor([ids]), cache).logits
        for _ in range(5):
            cache.evict()
            tiny_target.forward(torch.tensor([[7]]), cache)
        assert cache.length == 2 + 7 + 1 and cache.next_position == len(ids) + 5
    finally:
        tiny_target.kv_window = None
    full = tiny_target.forward(torch.tensor([ids]), tiny_target.new_cache()).logits
    assert not torch.allclose(windowed[0, -1], full[0, -1])  # the window really hides tokens
    assert generate(tiny_target, PROMPT, params).num_new_tokens == 40


@pytest.mark.parametrize("kind", ["ngram", "ngram-tree", "dflash", "ddtree"])
def test_speculative_decoding_is_lossless_under_a_window(tiny_target, kind):
    tiny_target.kv_window = StreamingWindow(sinks=2, window=12)
    try:
        for temp in (0.0, 1.0):
            params = SamplingParams(max_new_tokens=48, temperature=temp, seed=3)
            plain = generate(tiny_target, PROMPT, params)
            drafter = {
                "ngram": lambda: NgramDrafter(NgramConfig(block_size=4)),
                "ngram-tree": lambda: NgramDrafter(NgramConfig(block_size=4, num_candidates=3)),
                "dflash": lambda: DFlashDrafter(make_dflash(tiny_target, 6), tiny_target),
                "ddtree": lambda: DDTreeDrafter(DFlashDrafter(make_dflash(tiny_target, 6), tiny_target), budget=12),
            }[kind]()
            spec = generate(tiny_target, PROMPT, params, drafter=drafter)
            if temp == 0.0:
                assert spec.token_ids == plain.token_ids
            else:
                assert spec.num_new_tokens == 48  # sampled: equal in law (the suite's statistics), runs through
    finally:
        tiny_target.kv_window = None


def test_kv_flags_from_the_cli(tiny_llama_dir):
    import json
    import sys

    from cli_runs import run_all

    base = [sys.executable, "-m", "byblock.cli.main", "generate", PROMPT, "--model", str(tiny_llama_dir), "--json"]
    base += ["--max-new-tokens", "24"]
    extras = {
        "plain": ["--kv-window", "12", "--kv-sinks", "2"],
        "ngram": ["--kv-window", "12", "--kv-sinks", "2", "--drafter", "ngram"],
        "int4": ["--kv-quant", "int4", "--drafter", "ngram"],
        "int4-plain": ["--kv-quant", "int4"],
    }
    *results, bad = run_all([*([*base, *extra] for extra in extras.values()), [*base, "--kv-window", "-3"]])
    runs = {}
    for name, r in zip(extras, results, strict=True):
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout)["token_ids"]
    assert runs["plain"] == runs["ngram"] and runs["int4"] == runs["int4-plain"]
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("keep", [0, 1, 11])
def test_long_prefill_runs_in_window_chunks(tiny_target, keep):
    """A prompt longer than the window is prefilled chunk by chunk with eviction between chunks; every query
    sees the same sinks + window as under the explicit per-query mask, so outputs agree."""
    tiny_target.kv_window = StreamingWindow(sinks=2, window=8)
    try:
        ids = torch.tensor([tiny_target.encode_prompt(PROMPT, chat=True)])
        t = ids.shape[1]
        assert t > 3 * 8
        chunked_cache, explicit_cache = tiny_target.new_cache(), tiny_target.new_cache()
        chunked = tiny_target.forward(ids, chunked_cache, logits_to_keep=keep, hidden_layers=(0, 1))
        assert chunked_cache.length <= 2 + 2 * 8  # bounded during the prefill too
        explicit = tiny_target.forward(
            ids, explicit_cache, positions=torch.arange(t)[None], logits_to_keep=keep, hidden_layers=(0, 1)
        )
        torch.testing.assert_close(chunked.logits, explicit.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(chunked.hidden, explicit.hidden, rtol=1e-4, atol=1e-4)
        for cache in (chunked_cache, explicit_cache):
            cache.evict()
        assert chunked_cache.pos.tolist() == explicit_cache.pos.tolist()
        nxt = [tiny_target.forward(torch.tensor([[7]]), c).logits for c in (chunked_cache, explicit_cache)]
        torch.testing.assert_close(nxt[0], nxt[1], rtol=1e-4, atol=1e-4)
    finally:
        tiny_target.kv_window = None
