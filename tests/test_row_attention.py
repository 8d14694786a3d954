"""The row-local attention kernel (kernels/row_attention.py): its float64 definition, its invariance (a row's bits
depend only on its visible keys), its mask handling, and what it buys end to end: a verify forward gives every
row bitwise the logits of plain decode steps, on every fp32 linear kind including int8 activations (where torch's
SDPA left ~1e-7 differences that the activations' rounding turned into different tokens)."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from tiny import make_target

from byblock.kernels.row_attention import key_sets, load_row_attention, reference_attention, visible_rows


@pytest.fixture(scope="module")
def kernel():
    k = load_row_attention()
    if k is None:
        pytest.skip("byblock's row attention does not build here (no g++ or no AVX2)")
    return k


def _qkv(b=2, h=6, hkv=2, t=5, s=40, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g)
    return q, torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)


@pytest.mark.parametrize("d", [64, 48, 13])  # register chunks, a partial chunk, scalar tails only
def test_kernel_matches_the_float64_definition(kernel, d):
    q, k, v = _qkv(d=d)
    for visible in (None, torch.rand(2, 5, 40, generator=torch.Generator().manual_seed(1)) > 0.4):
        out = kernel(q, k, v, visible, 0.3)
        assert out.shape == (2, 5, 6, d)
        torch.testing.assert_close(out, reference_attention(q, k, v, visible, 0.3), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("d", [64, 128, 32, 48])  # the avx512 build's 64- and 32-wide passes; 48: its AVX2 path
def test_avx512_and_avx2_builds_give_the_same_bits(d):
    """The avx512 build keeps the AVX2 build's per-lane FMA sequences in 16-lane registers, so the two agree bit for
    bit: a result never depends on which machine class decoded it (plain decode vs verify stays exact either way)."""
    from byblock.kernels.cpu_features import cpu_flags

    if "avx512f" not in (cpu_flags() or ()):
        pytest.skip("no AVX-512 on this CPU")
    wide, narrow = load_row_attention("avx512"), load_row_attention("avx2")
    if wide is None or narrow is None:
        pytest.skip("byblock's row attention does not build here")
    for seed, s in ((0, 40), (1, 6), (2, 203)):  # few keys (a 4-key block and a tail); many keys, odd count
        q, k, v = _qkv(t=5, s=s, d=d, seed=seed)
        for visible in (None, torch.rand(2, 5, s, generator=torch.Generator().manual_seed(seed)) > 0.4):
            if visible is not None:
                visible[..., 0] = True
            assert torch.equal(wide(q, k, v, visible, 0.3), narrow(q, k, v, visible, 0.3)), (d, s)


def test_one_mask_row_broadcasts_over_the_batch(kernel):
    q, k, v = _qkv()
    visible = torch.rand(1, 5, 40, generator=torch.Generator().manual_seed(2)) > 0.5
    torch.testing.assert_close(kernel(q, k, v, visible, 0.125), kernel(q, k, v, visible.expand(2, 5, 40), 0.125))


def test_a_key_set_per_kv_head_is_each_head_groups_own_mask(kernel):
    """visible [B, Hkv, T, S] (sparse decode's per-KV-head choice): the query heads of KV head g read exactly
    the keys of mask g, as if that mask were the only one."""
    q, k, v = _qkv()  # 6 query heads over 2 KV heads
    visible = torch.rand(2, 2, 5, 40, generator=torch.Generator().manual_seed(4)) > 0.5
    visible[..., 0] = True  # every row sees a key
    out = kernel(q, k, v, visible, 0.2)
    for g in range(2):
        alone = kernel(q, k, v, visible[:, g], 0.2)
        assert torch.equal(out[:, :, 3 * g : 3 * g + 3], alone[:, :, 3 * g : 3 * g + 3]), g
    with pytest.raises(ValueError, match="visible must be"):
        kernel(q, k, v, visible.expand(2, 2, 5, 40).repeat(1, 2, 1, 1), 0.2)  # 4 mask heads for 2 KV heads


def test_a_rows_bits_depend_only_on_its_visible_keys(kernel):
    q, k, v = _qkv(t=7, s=50)
    causal = kernel(q, k, v, None, 0.125)
    for t in range(7):  # a chain row equals the same query decoded alone over its prefix
        n = 50 - 7 + t + 1
        assert torch.equal(kernel(q[:, :, t : t + 1], k[:, :, :n], v[:, :, :n], None, 0.125)[:, 0], causal[:, t])
    visible = torch.rand(2, 7, 50, generator=torch.Generator().manual_seed(3)) > 0.6
    tree = kernel(q, k, v, visible, 0.125)
    for b in range(2):
        for t in range(7):  # a tree row equals the query alone over its visible keys gathered in slot order
            keys = visible[b, t].nonzero()[:, 0]
            alone = kernel(q[b : b + 1, :, t : t + 1], k[b : b + 1, :, keys], v[b : b + 1, :, keys], None, 0.125)
            assert torch.equal(alone[0, 0], tree[b, t])


def test_strided_inputs_are_read_in_place(kernel):
    q, k, v = _qkv()
    big_k = torch.randn(2, 2, 64, 64)
    big_k[:, :, :40] = k  # a cache buffer with spare slots, sliced: the kernel honours its strides
    assert torch.equal(kernel(q, big_k[:, :, :40], v, None, 0.2), kernel(q, k, v, None, 0.2))


def test_visible_rows_takes_only_pure_visibility_masks():
    t, s = 3, 8
    boolean = torch.rand(1, 1, t, s) > 0.5
    assert torch.equal(visible_rows(boolean, t, s), boolean[:, 0])
    additive = torch.zeros(2, 1, t, s).masked_fill(~boolean, torch.finfo(torch.float32).min)
    assert torch.equal(visible_rows(additive, t, s), boolean[:, 0].expand(2, t, s))
    assert visible_rows(None, t, s) is None
    assert visible_rows(additive + 0.5, t, s) is False  # a bias, not a mask: SDPA applies it
    assert visible_rows(torch.ones(1, 2, t, s, dtype=torch.bool), t, s) is False  # per-head masks
    assert visible_rows(torch.ones(1, 1, t, s - 1, dtype=torch.bool), t, s) is False


def test_key_sets_convert_each_mask_once_and_forget_it_with_the_mask():
    t, s = 3, 8
    additive = torch.zeros(1, 1, t, s).masked_fill(torch.rand(1, 1, t, s) > 0.5, torch.finfo(torch.float32).min)
    first = key_sets(additive, t, s)
    assert first.dtype == torch.uint8 and torch.equal(first.bool(), visible_rows(additive, t, s))
    assert key_sets(additive, t, s) is first  # the next layer gets the same key sets, not a second scan
    assert key_sets(additive + 0.5, t, s) is False and key_sets(None, t, s) is None
    entries = len(key_sets._entries)
    del additive, first
    gc.collect()
    assert len(key_sets._entries) < entries  # the entry died with its mask


def test_bad_shapes_are_refused(kernel):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="group"):
        kernel(q[:, :5], k, v, None, 1.0)
    with pytest.raises(ValueError, match="visible must be"):
        kernel(q, k, v, torch.ones(2, 5, 39, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="at least as many keys"):
        kernel(q, k[:, :, :3], v[:, :, :3], None, 1.0)


def test_packed_segments_are_bitwise_each_segments_own_call(kernel):
    """`packed` (a whole packed forward's decode / verify segments in one call) writes each segment's new K/V
    into its buffers and gives each row the bits the per-segment call gives it: causal rows, a mask's key sets,
    strided inputs, segments of different pasts, however the rows are split between threads."""
    g = torch.Generator().manual_seed(3)
    h, hkv, d = 6, 2, 64
    specs = [(1, 17, None), (4, 30, "tree"), (3, 5, None), (2, 250, "tree")]  # (rows, past, mask)
    rows = sum(t for t, _, _ in specs)
    qkv = torch.randn(1, rows, h + 2 * hkv, d, generator=g).transpose(1, 2)  # strided, as the decoder's views
    q, k_new, v_new = qkv[:, :h], qkv[:, h : h + hkv], qkv[:, h + hkv :]
    table, want, bufs, masks, start = [], [], [], [], 0
    for t, past, mask in specs:
        kb, vb = torch.randn(2, 1, hkv, past + t + 7, d, generator=g)  # spare capacity past the rows
        keys = torch.cat([kb[:, :, :past], k_new[:, :, start : start + t]], 2)
        vals = torch.cat([vb[:, :, :past], v_new[:, :, start : start + t]], 2)
        vis = None
        if mask:
            vis = torch.rand(1, t, past + t, generator=g) > 0.3
            vis[..., -t:] = torch.eye(t, dtype=torch.bool)  # every row sees itself
            vis = vis.to(torch.uint8).contiguous()
            masks.append(vis)
        want.append(kernel(q[:, :, start : start + t], keys, vals, vis, 0.125)[0])
        bufs.append((kb, vb, keys, vals))
        table.append((start, start + t, past, kb.data_ptr(), vb.data_ptr(), *kb.stride()[1:3], *vb.stride()[1:3],
                      0 if vis is None else vis.data_ptr(), 1))  # fmt: skip
        start += t
    # The kernel splits each segment's rows into runs sized by the thread count (1: long runs, 8: one row each):
    # every split gives the same bits.
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 8):
            torch.set_num_threads(n)
            out = torch.full((rows, h, d), float("nan"))
            kernel.packed(q, k_new, v_new, torch.tensor(table), 0.125, out)
            assert torch.equal(out, torch.cat(want)), n
    finally:
        torch.set_num_threads(threads)
    for kb, vb, keys, vals in bufs:
        n = keys.shape[2]
        assert torch.equal(kb[:, :, :n], keys) and torch.equal(vb[:, :, :n], vals)
    with pytest.raises(ValueError, match="segment table"):
        kernel.packed(q, k_new, v_new, torch.tensor(table)[:, :5], 0.125, out)


def test_packed_forward_grows_each_cache_it_writes_directly():
    """The packed forward's one-call path grows a cache buffer that the new rows would overflow (here a past of
    255 slots in a buffer of 256) and leaves every cache as the per-request path does."""
    t = _target("llama", "packed")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, t.vocab_size, (n,), generator=g).tolist() for n in (255, 40)]
    solo, packed = ([_prefilled(t, p) for p in prompts] for _ in range(2))
    steps = [[7, 8, 9], [10, 11]]
    want = torch.cat([t.forward(torch.tensor([s]), c).logits[0] for s, c in zip(steps, solo, strict=True)])
    from byblock.models.adapter import SegmentInput

    segs = [SegmentInput(c, s) for c, s in zip(packed, steps, strict=True)]
    out = t.forward_packed(segs, list(range(5)))
    assert torch.equal(out.logits, want)
    for s, p in zip(solo, packed, strict=True):
        assert p.length == s.length
        for ls, lp in zip(s.hf.layers, p.hf.layers, strict=True):
            assert torch.equal(ls.keys, lp.keys) and torch.equal(ls.values, lp.values)


LINEARS = ("packed", "int8", "int4", "int8/fp32")


@functools.cache
def _target(arch: str, linears: str):
    weights, _, activations = linears.partition("/")
    quantized = weights.startswith("int")
    weights_arg = weights if quantized else None
    return make_target(arch, packed=not quantized, weights=weights_arg, activations=activations or "int8")


def _prefilled(t, prompt):
    cache = t.new_cache()
    t.forward(torch.tensor([prompt]), cache, logits_to_keep=1, prompt=True)
    return cache


def _decoded(t, prompt, tokens):
    """Logits of each of `tokens` decoded one step at a time after `prompt`."""
    cache = _prefilled(t, prompt)
    return torch.cat([t.forward(torch.tensor([[x]]), cache).logits[0] for x in tokens])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("linears", LINEARS)
def test_chain_and_tree_verifies_are_bitwise_plain_decode_steps(kernel, arch, linears):
    t = _target(arch, linears)
    prompt, chain = [5, 17, 3, 99, 41, 8, 250, 13, 77], [12, 200, 31, 7, 64, 150]
    verify = t.forward(torch.tensor([chain]), _prefilled(t, prompt)).logits[0]
    assert torch.equal(verify, _decoded(t, prompt, chain))
    # a tree: r -> (a, b), b -> c; every node's row is bitwise the plain steps along its path
    tokens, parents = [12, 200, 31, 7], [-1, 0, 0, 2]
    mask = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p], p = True, parents[p]
    depth = mask.sum(-1) - 1
    positions = (len(prompt) + depth)[None]
    tree = t.forward(torch.tensor([tokens]), _prefilled(t, prompt), positions=positions, tree_mask=mask).logits[0]
    for node, path in ((1, [12, 200]), (2, [12, 31]), (3, [12, 31, 7])):
        assert torch.equal(tree[node], _decoded(t, prompt, path)[-1]), node
