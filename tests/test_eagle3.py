"""EAGLE-3 drafter: losslessness (shared suite) for chains and dynamic trees, solo and batched, the head's cache
against one uncached pass, the checkpoint layout vLLM loads, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from lossless import SAMPLING_ALPHA, greedy_outputs_match, sampling_pvalue
from tiny import make_eagle3, make_target

from byblock import SamplingParams, generate
from byblock.drafters import DrafterSpec, build_drafter
from byblock.drafters.eagle3 import Eagle3Drafter
from byblock.drafters.eagle3_format import is_eagle3_checkpoint, load_eagle3, save_eagle3, to_hf_config
from byblock.errors import ByblockError

PROMPTS = ([5, 17, 33, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7, 12, 40])


@pytest.mark.parametrize("budget", [0, 12])
def test_eagle3_greedy_is_lossless(tiny_target, budget):
    """Token-identical to plain decoding on every tiny architecture, chain (budget 0) and dynamic tree."""
    drafter = Eagle3Drafter(make_eagle3(tiny_target), tiny_target, depth=4, budget=budget, top_k=3)
    for prompt in PROMPTS:
        _, spec = greedy_outputs_match(tiny_target, prompt, SamplingParams(max_new_tokens=40), drafter)
        assert spec.stats.rounds > 0


def test_trees_respect_budget_depth_and_vocabulary(tiny_targets):
    target = tiny_targets["qwen3"]
    vocab = torch.arange(0, target.vocab_size, 3)
    drafter = Eagle3Drafter(make_eagle3(target, vocab), target, depth=5, budget=10, top_k=3)
    drafted = drafter.propose
    shapes = []

    def checked(tokens, max_depth):
        d = drafted(tokens, max_depth)
        assert d.num_nodes <= 10 and int(d.depths().max()) <= min(5, max_depth)
        assert set(d.tokens.tolist()) <= set(vocab.tolist())
        shapes.append(d.is_chain)
        return d

    drafter.propose = checked
    greedy_outputs_match(target, [5, 17, 33, 9], SamplingParams(max_new_tokens=30), drafter)
    assert not all(shapes)  # real trees were proposed, not just chains


@pytest.mark.parametrize("budget", [0, 8])
def test_eagle3_sampling_matches_target_distribution(budget):
    """First 4 sampled tokens (sampled chains with q; deterministic trees) vs the exactly computed joint law."""
    target = make_target("llama")
    params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4)
    model = make_eagle3(target, torch.arange(target.vocab_size - 1))
    drafter = Eagle3Drafter(model, target, depth=3, budget=budget, top_k=2)
    assert sampling_pvalue(target, drafter, [5, 17, 33, 9, 5, 17], params) > SAMPLING_ALPHA


def test_batched_eagle3_equals_each_request_alone(tiny_targets):
    target = tiny_targets["llama"]
    drafter = Eagle3Drafter(make_eagle3(target), target, depth=3, budget=6, top_k=2)
    prompts = [[5, 17, 33, 9], [7, 7, 7, 12, 40], [1, 2, 3]]
    params = SamplingParams(max_new_tokens=24)
    batch = generate(target, prompts, params, drafter=drafter)
    for prompt, res in zip(prompts, batch, strict=True):
        assert res.token_ids == generate(target, prompt, params).token_ids


def test_context_cache_over_rounds_equals_one_pass(tiny_targets):
    """The committed positions' outputs fed in pieces (as rounds do) equal one causal pass over all of them."""
    target = tiny_targets["llama"]
    model = make_eagle3(target)
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 11, h, generator=g)
    feats = model.fc(torch.randn(1, 11, len(model.config.target_layer_ids) * h, generator=g)).detach()
    pos = torch.arange(11)[None]
    with torch.no_grad():
        full, _ = model.step(embeds, feats, pos, [], None)
        past, outs = [], []
        for a, b in ((0, 6), (6, 9), (9, 11)):
            out, kv = model.step(embeds[:, a:b], feats[:, a:b], pos[:, a:b], past, None)
            past.append(kv)
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)


def test_checkpoint_roundtrip_in_the_layout_vllm_loads(tmp_path, tiny_targets):
    target = tiny_targets["llama"]
    vocab = torch.tensor([0, 2, 3, 10, 200])
    model = make_eagle3(target, vocab)
    save_eagle3(model, tmp_path / "ck", dtype=torch.float32)
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    assert raw["draft_vocab_size"] == 5 and raw["vocab_size"] == target.vocab_size
    aux = raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert aux == [i + 1 for i in model.config.target_layer_ids]  # vLLM captures layer L's input = i + 1
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= keys
    assert {"midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= keys
    assert not any("embed" in k for k in keys)
    assert is_eagle3_checkpoint(tmp_path / "ck")
    loaded = load_eagle3(tmp_path / "ck")
    assert torch.equal(loaded.draft_vocab(), vocab)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert to_hf_config(loaded.config, torch.float32) == raw
    spec = DrafterSpec.parse(f"eagle3tree:{tmp_path / 'ck'}", tree_budget=7)
    built = build_drafter(spec, target)
    assert isinstance(built, Eagle3Drafter) and built.budget == 7


def test_bad_checkpoints_and_mismatched_targets_are_one_line_errors(tmp_path, tiny_targets):
    with pytest.raises(ByblockError, match="not an EAGLE-3 checkpoint"):
        load_eagle3(tmp_path)
    model = make_eagle3(tiny_targets["llama"])
    save_eagle3(model, tmp_path / "ck")
    with pytest.raises(ByblockError, match="does not fit"):  # trained for a 320-token vocabulary
        Eagle3Drafter(load_eagle3(tmp_path / "ck"), make_target("llama", vocab_size=256))
    with pytest.raises(ByblockError, match="no EAGLE-3 head ships"):
        build_drafter(DrafterSpec.parse("eagle3"), tiny_targets["llama"])
    with pytest.raises(ByblockError, match="needs the target's hidden states"):
        Eagle3Drafter(model, tiny_targets["llama"]).start([1, 2], None, SamplingParams(), None)


def test_one_batch_serves_drafters_with_different_feature_layers(tiny_targets):
    """An EAGLE-3 request beside a DFlash one (other feature layers): each gets its own layers' columns of the
    packed forward's hidden states, and its solo tokens."""
    from tiny import make_dflash

    from byblock.drafters.dflash import DFlashDrafter
    from byblock.engine.batched import BatchedEngineCore
    from byblock.engine.core import EngineRequest
    from byblock.engine.sequence import own_layers

    hidden = torch.arange(12.0).view(1, 1, 12)  # layers (0, 1, 2) of width 4 side by side
    assert torch.equal(own_layers(hidden, (0, 1, 2), (2, 0)), torch.cat([hidden[..., 8:], hidden[..., :4]], -1))
    target = tiny_targets["llama"]
    eagle = Eagle3Drafter(make_eagle3(target, layer_ids=(1,)), target, depth=3, budget=5, top_k=2)
    dflash = DFlashDrafter(make_dflash(target, block=4), target)
    assert eagle.hidden_layers == (1,) and dflash.hidden_layers == (0, 1)
    core = BatchedEngineCore(target, {"eagle3": eagle, "dflash": dflash})
    params = SamplingParams(max_new_tokens=20)
    prompts = {"a": ([5, 17, 33, 9], "eagle3"), "b": ([7, 7, 7, 12, 40], "dflash"), "c": ([1, 2, 3], "eagle3")}
    for rid, (ids, name) in prompts.items():
        core.add_request(EngineRequest(rid, tuple(ids), params, name))
    results = {}
    while core.has_unfinished():
        for out in core.step():
            assert out.error is None, out.error
            if out.result is not None:
                results[out.request_id] = out.result
    for rid, (ids, _) in prompts.items():
        assert results[rid].token_ids == generate(target, ids, params).token_ids


def test_export_for_vllm_and_launch_name_the_eagle3_method(tmp_path, tiny_targets, tiny_llama_dir):
    import os
    import shlex
    import subprocess
    import sys

    head = save_eagle3(make_eagle3(tiny_targets["llama"], torch.arange(0, 320, 2)), tmp_path / "head")
    cli = [sys.executable, "-m", "byblock.cli.main"]
    out = tmp_path / "vllm"
    export = [*cli, "export", "--drafter", f"eagle3:{head}", "--target", str(tiny_llama_dir)]
    r = subprocess.run([*export, "--format", "vllm", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    spec = line["speculative_config"]
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 7
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_eagle3(out).draft_vocab(), torch.arange(0, 320, 2))
    env = {**os.environ, "BYBLOCK_VLLM_PYTHON": str(tmp_path / "none")}  # printing needs no engine
    r = subprocess.run(
        [*cli, "launch", "vllm", "--target", str(tiny_llama_dir), "--exported", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.strip())
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 7
    bad = subprocess.run([*export, "--format", "llamacpp", "--out", str(tmp_path / "x.gguf")], capture_output=True)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and b"Traceback" not in bad.stderr
