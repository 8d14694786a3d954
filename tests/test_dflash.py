"""DFlash drafter: losslessness (shared suite), cache exactness, checkpoint format, reference cross-check."""

from __future__ import annotations

import json

import pytest
import torch
from lossless import SAMPLING_ALPHA, greedy_outputs_match, sampling_pvalue
from tiny import make_dflash, make_target

from byblock import SamplingParams
from byblock.drafters import DrafterSpec, build_drafter
from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.dflash_format import load_dflash, save_dflash, to_hf_config
from byblock.errors import ByblockError


@pytest.mark.parametrize("block", [2, 4, 8])
def test_dflash_greedy_is_lossless(tiny_target, block):
    """Token-identical to plain decoding on every tiny architecture and block size."""
    drafter = DFlashDrafter(make_dflash(tiny_target, block=block), tiny_target)
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([5, 17, 33, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7, 12, 40]):
        _, spec = greedy_outputs_match(tiny_target, prompt, params, drafter)
        assert spec.stats.rounds > 0


def test_dflash_with_draft_vocab_is_lossless(tiny_targets):
    target = tiny_targets["qwen3"]
    vocab = torch.arange(0, target.vocab_size, 3)
    drafter = DFlashDrafter(make_dflash(target), target, draft_vocab=vocab)
    drafted = drafter.propose  # every proposal must be a target id inside the draft vocabulary

    def checked(tokens, max_depth):
        d = drafted(tokens, max_depth)
        assert set(d.tokens.tolist()) <= set(vocab.tolist())
        return d

    drafter.propose = checked
    greedy_outputs_match(target, [5, 17, 33, 9], SamplingParams(max_new_tokens=30), drafter)


def test_dflash_sampling_matches_target_distribution():
    """First 4 sampled tokens through the engine with a DFlash drafter vs the exactly computed joint law."""
    target = make_target("llama")
    params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4)
    prompt = [5, 17, 33, 9, 5, 17]
    drafter = DFlashDrafter(make_dflash(target, block=4), target, draft_vocab=torch.arange(target.vocab_size - 1))
    assert sampling_pvalue(target, drafter, prompt, params) > SAMPLING_ALPHA


def test_cached_rounds_equal_one_uncached_forward(tiny_targets):
    """Context K/V cached over rounds gives the same block states as one pass over the whole context."""
    target = tiny_targets["llama"]
    model = make_dflash(target, block=4)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 11, cfg.num_features * cfg.hidden_size, generator=g)  # 11 context positions
    block = torch.randn(1, 4, cfg.hidden_size, generator=g)
    bpos = torch.arange(11, 15)[None]
    with torch.no_grad():
        full = model(block, feats, bpos, torch.arange(11)[None])
        cache = [[] for _ in model.layers]
        model(block, feats[:, :6], torch.arange(6, 10)[None], torch.arange(6)[None], cache=cache)
        model(block, feats[:, 6:9], torch.arange(9, 13)[None], torch.arange(6, 9)[None], cache=cache)
        cached = model(block, feats[:, 9:], bpos, torch.arange(9, 11)[None], cache=cache)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_checkpoint_roundtrip_and_layout(tmp_path, tiny_targets):
    target = tiny_targets["llama"]
    model = make_dflash(target, block=4)
    vocab = torch.tensor([0, 2, 3, 10, 200])
    save_dflash(model, tmp_path / "ck", dtype=torch.float32, draft_vocab=vocab)
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 4 and raw["num_target_layers"] == target.num_layers
    assert raw["dflash_config"] == {"mask_token_id": target.vocab_size - 1, "target_layer_ids": [0, 1]}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
    assert "layers.1.mlp.down_proj.weight" in keys and not any("embed" in k or "lm_head" in k for k in keys)
    loaded, loaded_vocab = load_dflash(tmp_path / "ck")
    assert torch.equal(loaded_vocab, vocab)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    assert to_hf_config(loaded.config, torch.float32) == raw


def test_bad_checkpoints_and_mismatched_targets_are_one_line_errors(tmp_path, tiny_targets):
    with pytest.raises(ByblockError, match="not a DFlash checkpoint"):
        load_dflash(tmp_path)
    model = make_dflash(tiny_targets["llama"])
    save_dflash(model, tmp_path / "ck")
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    del raw["dflash_config"]["mask_token_id"]
    (tmp_path / "ck" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ByblockError, match="mask_token_id"):
        load_dflash(tmp_path / "ck")
    wrong = make_dflash(tiny_targets["gemma3"])  # feature layer 3 does not exist in the 2-layer llama
    with pytest.raises(ByblockError, match="does not fit"):
        DFlashDrafter(wrong, tiny_targets["llama"])
    with pytest.raises(ByblockError, match="no DFlash drafter ships"):
        build_drafter(DrafterSpec.parse("dflash"), tiny_targets["llama"])


def test_reference_implementation_gives_equal_draft_logits(tmp_path, tiny_targets):
    """Export, load into the reference `dflash` package's DFlashDraftModel, compare draft logits."""
    ref = pytest.importorskip("dflash.model")
    target = tiny_targets["qwen3"]
    model = make_dflash(target, block=4)
    save_dflash(model, tmp_path / "ck", dtype=torch.float32)
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path / "ck"), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    ctx = 9
    feats = torch.randn(1, ctx, 2 * target.hidden_size, generator=g)
    ids = torch.tensor([[17] + [model.config.mask_token_id] * 3])
    emb = target.hf.get_input_embeddings().weight[ids]  # [1, 4, H]
    head = target.hf.get_output_embeddings()
    with torch.no_grad():
        ours = model(emb, feats, torch.arange(ctx, ctx + 4)[None], torch.arange(ctx)[None])
        their_h = theirs(
            position_ids=torch.arange(ctx + 4)[None], noise_embedding=emb, target_hidden=feats, use_cache=False
        )
        torch.testing.assert_close(head(ours[:, 1:]), head(their_h[:, 1:]), rtol=1e-5, atol=1e-5)


def test_packed_target_and_drafter_are_lossless(monkeypatch):
    """fp32 on byblock's packed GEMM (the default load for fp32): the target's linears, the drafter's layers
    and its restricted LM head all on the kernel; greedy output equals plain decoding on the same target."""
    from byblock.kernels.packed_gemm import PackedLinear, load_kernel, pack_linears

    target = make_target("llama", packed=True)
    model = make_dflash(target, block=8)
    assert pack_linears(model, load_kernel()) > 0
    drafter = DFlashDrafter(model, target, draft_vocab=torch.arange(0, target.vocab_size, 2))
    assert isinstance(drafter.packed_head, PackedLinear) and drafter.head_t is None
    unpacked = []  # `.weight` of a PackedLinear unpacks a fresh copy: never in the decode loop
    monkeypatch.setattr(PackedLinear, "weight", property(lambda self: unpacked.append(self) or 1 / 0))
    for prompt in ([5, 17, 33, 9], [7, 7, 7]):
        greedy_outputs_match(target, prompt, SamplingParams(max_new_tokens=40), drafter)
    assert not unpacked


def test_bf16_drafter_is_lossless(tiny_targets):
    """The drafter may run in bf16 (cheaper); verification keeps the output exact."""
    target = tiny_targets["llama"]
    drafter = DFlashDrafter(make_dflash(target, block=8), target, dtype=torch.bfloat16)
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    greedy_outputs_match(target, [5, 17, 33, 9], SamplingParams(max_new_tokens=40), drafter)


def _windowed_drafter(target, window: int | None):
    from dataclasses import replace

    from byblock.drafters.dflash_model import DFlashDraftModel

    base = make_dflash(target, block=4)
    model = DFlashDraftModel(replace(base.config, sliding_window=window)).eval()
    model.load_state_dict(base.state_dict())
    return model


def test_sliding_window_drafting_equals_the_training_mask():
    """MiMo's SWA drafter: cached rounds (the cache trimmed to the window) give the block states the training
    mask gives over the whole context (row j at position a + j sees context q with a + j - q < W)."""
    target = make_target("llama")
    g = torch.Generator().manual_seed(0)
    for window in (5, 7, 40):
        model = _windowed_drafter(target, window)
        cfg = model.config
        feats = torch.randn(1, 14, cfg.num_features * cfg.hidden_size, generator=g)
        block = torch.randn(1, 4, cfg.hidden_size, generator=g)
        a = 14
        mask = torch.zeros(1, 1, 4, 14 + 4, dtype=torch.bool)
        mask[..., 14:] = True
        for r in range(4):
            mask[0, 0, r, max(0, a + r - window + 1) : a] = True
        with torch.no_grad():
            ref = model(block, feats, torch.arange(a, a + 4)[None], torch.arange(14)[None], mask=mask)
            cache = [[] for _ in model.layers]
            model(block, feats[:, :6], torch.arange(6, 10)[None], torch.arange(6)[None], cache=cache)
            model(block, feats[:, 6:11], torch.arange(11, 15)[None], torch.arange(6, 11)[None], cache=cache)
            got = model(block, feats[:, 11:], torch.arange(a, a + 4)[None], torch.arange(11, 14)[None], cache=cache)
            assert all(c[0].shape[2] <= window - 1 for c in cache)  # nothing older than the window is kept
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    wide = _windowed_drafter(target, 40)
    full = make_dflash(target, block=4)
    with torch.no_grad():  # a window wider than the context is full attention
        args = (block, feats, torch.arange(14, 18)[None], torch.arange(14)[None])
        torch.testing.assert_close(wide(*args), full(*args), rtol=0, atol=0)


def test_sliding_window_drafter_is_lossless_and_round_trips_in_vllms_fields(tmp_path):
    target = make_target("llama")
    model = _windowed_drafter(target, 6)
    greedy_outputs_match(
        target, [5, 17, 33, 9, 4, 4, 8], SamplingParams(max_new_tokens=30), DFlashDrafter(model, target)
    )
    hf = to_hf_config(model.config)
    assert hf["dflash_config"]["use_swa"] is True and hf["dflash_config"]["swa_window_size"] == 6
    assert hf["sliding_window"] == 6 and set(hf["layer_types"]) == {"sliding_attention"}
    # vLLM reads a "sliding_attention" layer as causal unless told (qwen3_dflash._dflash_layer_causal); the
    # drafter's block rows see each other, so the export says so
    assert hf["dflash_config"]["causal"] is False
    save_dflash(model, tmp_path / "swa")
    loaded, _ = load_dflash(tmp_path / "swa")
    assert loaded.config.sliding_window == 6
    assert to_hf_config(make_dflash(target).config)["dflash_config"].get("use_swa") is None


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_drafter_beside_a_quantized_target_runs_int8_groups_and_is_lossless(tmp_path, weights):
    """build_dflash puts the drafter on the target's quantized kernel (int8 groups): a cheap drafter for a cheap
    target, and greedy output still equals plain decoding on that target."""
    from byblock.kernels.quant_gemm import QuantLinear

    target = make_target("llama", weights=weights)
    save_dflash(make_dflash(target, block=6), tmp_path / "ck", dtype=torch.float32)
    drafter = build_drafter(DrafterSpec.parse(f"dflash:{tmp_path / 'ck'}"), target)
    layers = [m for m in drafter.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.qweight.bits == 8 for m in layers)
    assert not any(type(m) is torch.nn.Linear for m in drafter.model.modules())
    for prompt in ([5, 17, 33, 9], [7, 7, 7]):
        _, spec = greedy_outputs_match(target, prompt, SamplingParams(max_new_tokens=40), drafter)
        assert spec.stats.rounds > 0


def test_fused_rms_norm_is_the_composition_bitwise():
    """The drafter module's fp32 RMSNorm (the reference and training forward's, not drafting's: dflash_packed.py)
    runs torch's fused op without grad; it must give the composition's bits, which training uses."""
    from byblock.drafters.dflash_model import RMSNorm

    g = torch.Generator().manual_seed(0)
    for dim, shape in ((64, (3, 9, 5)), (576, (1, 17)), (576, (2, 40, 3))):
        norm = RMSNorm(dim, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=g))
        x = torch.randn(*shape, dim, generator=g) * 3
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        with torch.inference_mode():
            assert torch.equal(norm(x), norm.weight * ref)
