"""Stem sparse prefill: the gather kernel against dense masked attention, full budget against SDPA,
the estimator against its definition, and the transformers integration on llama / qwen3 / gemma3."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import make_hf_model

from byblock.attention.hf_stem import enable_stem
from byblock.attention.stem import (
    Backend,
    Decay,
    StemConfig,
    block_sparse_attention,
    causal_density,
    dense_reference,
    oam_block_logits,
    select_blocks,
    tpd_budgets,
)

BS = 16


def qkv(seed: int, b: int = 2, h: int = 3, length: int = 128, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, d, generator=g) for _ in range(3)]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("padded", [False, True])
def test_gather_kernel_equals_dense_masked_attention(seed, padded):
    q, k, v = qkv(seed)
    n = q.shape[2] // BS
    g = torch.Generator().manual_seed(100 + seed)
    mask = (torch.rand(2, 3, n, n, generator=g) < 0.4) | torch.eye(n, dtype=torch.bool)
    mask &= torch.ones(n, n, dtype=torch.bool).tril()
    valid = None
    if padded:
        valid = torch.ones(2, q.shape[2], dtype=torch.bool)
        valid[1, :21] = False  # left padding of row 1
    got = block_sparse_attention(q, k, v, mask, BS, 0.35, chunk=3, key_valid=valid)
    ref = dense_reference(q, k, v, mask, BS, 0.35, key_valid=valid)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_flex_backend_equals_dense_masked_attention():
    from byblock.attention.stem import DensityLog, block_sparse_attention_flex

    q, k, v = qkv(11, length=256)
    n = q.shape[2] // BS
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(2, 3, n, n, generator=g) < 0.3) | torch.eye(n, dtype=torch.bool)
    mask &= torch.ones(n, n, dtype=torch.bool).tril()
    got = block_sparse_attention_flex(q, k, v, mask, BS, 0.35, DensityLog())
    ref = dense_reference(q, k, v, mask, BS, 0.35)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_full_budget_is_dense_causal_attention():
    q, k, v = qkv(7)
    cfg = StemConfig(sparsity=0.0, block_size=BS, stride=4)
    mask = select_blocks(oam_block_logits(q, k, v, cfg, 0.35), tpd_budgets(q.shape[2] // BS, cfg), cfg)
    assert causal_density(mask) == 1.0
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.35)
    torch.testing.assert_close(block_sparse_attention(q, k, v, mask, BS, 0.35), sdpa, rtol=1e-5, atol=1e-5)


def test_antidiagonal_estimate_matches_its_definition():
    q, k, v = qkv(3, b=1, h=1, length=32, d=4)
    cfg = StemConfig(block_size=8, stride=4, oam_beta=0.0)
    got = oam_block_logits(q, k, v, cfg, scale=1.0)
    s, per, n = 4, 2, 4
    est = torch.zeros(8, 8)
    for i in range(8):
        for j in range(8):
            est[i, j] = sum(float(q[0, 0, s * i + s - 1 - t] @ k[0, 0, s * j + t]) for t in range(s)) / s
    want = est.view(n, per, n, per).mean(dim=(1, 3))
    want = want.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(got[0, 0], want, rtol=1e-5, atol=1e-5)


def test_value_bonus_raises_blocks_with_large_values():
    q, k, v = qkv(4, b=1, h=1, length=64, d=8)
    v[:, :, 16:32] *= 50.0  # key block 1 carries large values
    plain = oam_block_logits(q, k, v, StemConfig(block_size=BS, stride=4, oam_beta=0.0), 1.0)
    aware = oam_block_logits(q, k, v, StemConfig(block_size=BS, stride=4, oam_beta=0.5), 1.0)
    bonus = (aware - plain)[0, 0, 3]
    assert bonus[1] > 0 and bonus[1] == bonus.max()


@pytest.mark.parametrize("decay", list(Decay))
def test_tpd_budgets(decay):
    cfg = StemConfig(sparsity=0.75, alpha=0.5, decay=decay)
    b = tpd_budgets(64, cfg)
    k = 16
    assert (b[:k] == k).all() and (b[k:] <= k).all() and (b[1:] <= b[:-1]).all()
    assert b[-1] == k // 2
    assert (tpd_budgets(4, cfg) == torch.tensor([3, 3, 3, 3])).all()  # never below sinks + local


def hf_logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_transformers_model_at_full_budget_equals_sdpa(arch):
    ids = torch.randint(3, 300, (2, 200), generator=torch.Generator().manual_seed(0))
    pad = torch.ones_like(ids)
    pad[1, :13] = 0  # left padding in row 1
    dense = make_hf_model(arch, max_position_embeddings=512)
    ref = hf_logits(dense, ids, pad)
    sparse = make_hf_model(arch, max_position_embeddings=512)
    cfg = StemConfig(sparsity=0.0, block_size=BS, stride=4, min_tokens=64, dense_layers=0, backend=Backend.GATHER)
    density = enable_stem(sparse, cfg)
    got = hf_logits(sparse, ids, pad)
    real = pad.bool()
    torch.testing.assert_close(got[real], ref[real], rtol=1e-4, atol=1e-4)
    assert density.per_layer and all(v == 1.0 for v in density.per_layer.values())
    assert density.kernel_layers  # the block-sparse kernel really ran (with the padding mask)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sparse_prefill_runs_sparse_only_where_it_should(arch):
    ids = torch.randint(3, 300, (1, 256), generator=torch.Generator().manual_seed(1))
    model = make_hf_model(arch, max_position_embeddings=512)
    cfg = StemConfig(sparsity=0.75, block_size=BS, stride=4, min_tokens=64, dense_layers=1, backend=Backend.GATHER)
    density = enable_stem(model, cfg)
    out = hf_logits(model, ids)
    assert torch.isfinite(out).all()
    layers = model.config.num_hidden_layers
    sparse_layers = [i for i, d in density.per_layer.items() if d < 1.0]
    assert 0 not in sparse_layers and sparse_layers  # dense_layers stay dense, later global layers go sparse
    if arch == "gemma3":  # sliding-window layers stay as they are; only the global layer (3) is sparse
        assert sparse_layers == [layers - 1]
    assert 0.2 < density.mean() < 0.7


@pytest.mark.slow
def test_flex_backend_in_a_transformers_model_at_full_budget():
    ids = torch.randint(3, 300, (1, 192), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(make_hf_model("llama", max_position_embeddings=512), ids)
    sparse = make_hf_model("llama", max_position_embeddings=512)
    density = enable_stem(sparse, StemConfig(sparsity=0.0, block_size=BS, stride=4, min_tokens=64, dense_layers=0))
    torch.testing.assert_close(hf_logits(sparse, ids), ref, rtol=1e-4, atol=1e-4)
    assert density.kernel_layers == {0, 1} and density.flex is not None


def test_sparse_flags_from_the_cli(tiny_llama_dir):
    import json
    import sys

    from cli_runs import run_all

    prompt = "The quick brown fox jumps over the lazy dog. " * 30
    base = [sys.executable, "-m", "byblock.cli.main", "generate", prompt, "--model", str(tiny_llama_dir), "--no-chat"]
    flags = ["--max-new-tokens", "4", "--json", "--sparse-block", "16", "--sparse-min-tokens", "64"]
    flags += ["--sparse-dense-layers", "1", "--sparse-backend", "gather"]
    decode_flags = ["--sparse-decode", "2", "--sparse-decode-window", "16", "--sparse-decode-min-tokens", "0"]
    decode_flags += ["--max-new-tokens", "6"]
    runs = run_all(
        [
            [*base, *flags],
            [*base, *flags, "--sparse", "stem", "--sparsity", "0"],
            [*base, *flags, "--sparse", "stem", "--sparsity", "0.9"],
            [*base, *flags, *decode_flags],
            [*base, "--sparse", "stem", "--sparsity", "1.5"],
            [*base, "--sparse", "stem", "--sparse-share-layers", "0"],
            [*base, "--sparse-decode", "2", "--kv-window", "64"],
            [*base, "--sparse-decode", "-1"],
            [*base, "--sparse-decode", "2", "--sparse-decode-min-tokens", "-5"],
        ]
    )
    assert all(r.returncode == 0 for r in runs[:3]), [r.stderr for r in runs[:3]]
    dense, full = json.loads(runs[0].stdout), json.loads(runs[1].stdout)
    assert full["token_ids"] == dense["token_ids"] and "stem_density" not in dense
    sparse = runs[2]
    out = json.loads(sparse.stdout)
    assert out["stem_density"]["0"] == 1.0 and out["stem_density"]["1"] < 0.6
    assert "warning: --sparsity 0.9" in sparse.stderr
    assert runs[3].returncode == 0, runs[3].stderr
    decode = json.loads(runs[3].stdout)
    assert "stem_density" not in decode and decode["decode_density"]["1"] < 0.6  # prefill dense, decode sparse
    for bad in runs[4:]:
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


@pytest.mark.slow
def test_gemma_sliding_layers_take_the_flex_window_kernel_and_stay_exact():
    ids = torch.randint(3, 300, (1, 192), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(make_hf_model("gemma3", max_position_embeddings=512), ids)
    model = make_hf_model("gemma3", max_position_embeddings=512)
    cfg = StemConfig(sparsity=0.0, block_size=BS, stride=4, min_tokens=64, dense_layers=0)
    density = enable_stem(model, cfg)
    torch.testing.assert_close(hf_logits(model, ids), ref, rtol=1e-4, atol=1e-4)
    assert density.kernel_layers == {3} and density.window_layers == {0, 1, 2}  # sliding layers: the window kernel


def _recording(monkeypatch):
    """Record every block mask Stem chooses (select_blocks) and every one its kernel attends with."""
    import byblock.attention.hf_stem as hf_stem

    chosen, used = [], []
    select, kernel = hf_stem.select_blocks, hf_stem.block_sparse_attention

    def select_rec(*a, **kw):
        chosen.append(select(*a, **kw))
        return chosen[-1]

    def kernel_rec(q, k, v, mask, *a, **kw):
        used.append(mask)
        return kernel(q, k, v, mask, *a, **kw)

    monkeypatch.setattr(hf_stem, "select_blocks", select_rec)
    monkeypatch.setattr(hf_stem, "block_sparse_attention", kernel_rec)
    return chosen, used


@pytest.mark.parametrize("share", [1, 2, 3, 4])  # 4: one group, where a stale mask would be found
def test_shared_index_is_chosen_once_per_group_and_reused(monkeypatch, share):
    """--sparse-share-layers N: the first sparse layer of each group of N scores and selects; the next N-1
    attend with exactly that mask (the same tensor), and a second prompt of the same shape never reuses the
    first prompt's masks."""
    chosen, used = _recording(monkeypatch)
    model = make_hf_model("llama", max_position_embeddings=512, num_hidden_layers=5)
    cfg = StemConfig(0.75, block_size=BS, stride=4, min_tokens=64, dense_layers=1, backend=Backend.GATHER)
    cfg = replace(cfg, share_layers=share)
    density = enable_stem(model, cfg)
    gen = torch.Generator().manual_seed(3)
    for prompt in range(2):
        chosen.clear(), used.clear()
        hf_logits(model, torch.randint(3, 300, (1, 256), generator=gen))
        groups = [cfg.index_group(layer) for layer in range(1, 5)]  # layers 1..4 are sparse
        assert len(used) == 4 and len(chosen) == len(set(groups))
        anchors = [chosen[sorted(set(groups)).index(g)] for g in groups]
        assert all(u is a for u, a in zip(used, anchors, strict=True)), prompt
    assert density.shared_layers == {1: set(), 2: {2, 4}, 3: {2, 3}, 4: {2, 3, 4}}[share]
    if share == 1:  # per layer, the layers really choose different blocks (so sharing is a real change)
        assert any(not torch.equal(used[0], m) for m in used[1:])


def test_shared_index_at_full_budget_is_still_dense_attention():
    ids = torch.randint(3, 300, (1, 192), generator=torch.Generator().manual_seed(5))
    ref = hf_logits(make_hf_model("llama", max_position_embeddings=512, num_hidden_layers=4), ids)
    model = make_hf_model("llama", max_position_embeddings=512, num_hidden_layers=4)
    cfg = StemConfig(0.0, block_size=BS, stride=4, min_tokens=64, dense_layers=0, backend=Backend.GATHER)
    cfg = replace(cfg, share_layers=2)
    density = enable_stem(model, cfg)
    torch.testing.assert_close(hf_logits(model, ids), ref, rtol=1e-4, atol=1e-4)
    assert density.shared_layers == {1, 3}


def test_share_layers_must_be_positive():
    from byblock.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="share-layers"):
        StemConfig(share_layers=0)
