"""byblock's packed fp32 GEMM (kernels/csrc/packed_gemm.cpp) against its dense reference, F.linear in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from byblock.kernels import packed_gemm
from byblock.kernels.packed_gemm import PackedLinear, load_kernel, pack_linears


@pytest.fixture(scope="module")
def kernel():
    k = load_kernel()
    if k is None:
        pytest.skip("byblock's packed GEMM does not build here (no g++ or no AVX2)")
    return k


def dense(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The reference: y = x W^T + b in fp64."""
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(0, 40),
    n=st.integers(1, 150),
    k=st.integers(1, 200),
    bias=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_matches_dense_reference(kernel, m, n, k, bias, seed):
    """Any row count (1 row x 4 panels, 2-3 rows x 2 panels, balanced passes of <= 6 rows), widths off the
    16-column panel (odd panel counts, a partial last panel), odd depths."""
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = PackedLinear(w, b, kernel)(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), dense(x, w, b), atol=1e-4 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(64, 48), (100, 37), (49152 // 16, 576)])
def test_rows_are_bitwise_invariant(kernel, n, k):
    """A row's output does not depend on how many rows share the call, nor on its place among them."""
    torch.manual_seed(0)
    lin = PackedLinear(torch.randn(n, k), torch.randn(n), kernel)
    x = torch.randn(33, k)
    full = lin(x)
    for lo, hi in [(0, 1), (5, 6), (0, 2), (2, 5), (3, 8), (4, 13), (1, 18), (7, 33), (0, 32)]:
        assert torch.equal(lin(x[lo:hi]), full[lo:hi]), (lo, hi)


def test_batched_leading_dims_and_strided_input(kernel):
    torch.manual_seed(1)
    w = torch.randn(40, 24)
    lin = PackedLinear(w, None, kernel)
    x = torch.randn(2, 3, 48)[..., ::2]  # [2, 3, 24], not contiguous
    torch.testing.assert_close(lin(x).double(), dense(x, w, None), atol=1e-4, rtol=1e-5)


def test_weight_round_trips_and_autograd_falls_back(kernel):
    torch.manual_seed(2)
    ref = torch.nn.Linear(37, 50)
    lin = PackedLinear.from_linear(ref, kernel)
    assert torch.equal(lin.weight, ref.weight) and lin.weight_t.shape == (37, 50)
    x = torch.randn(4, 37, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, ref.weight.detach().sum(0).expand(4, 37))
    with torch.no_grad():  # bf16 input: F.linear on an unpacked copy
        xb = torch.randn(3, 37).bfloat16()
        assert lin(xb).dtype == torch.bfloat16


def test_pack_linears_replaces_only_fp32_linears(kernel):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4).bfloat16())
    assert pack_linears(model, kernel) == 1
    assert isinstance(model[0], PackedLinear) and type(model[2]) is torch.nn.Linear
    assert any(p.numel() == 16 * 8 for p in model.parameters())  # the packed weight counts as a parameter


def test_load_model_packs_fp32_by_default(kernel, tiny_llama_dir):
    from byblock.kernels.fast_linear import InOutLinear
    from byblock.models.loading import load_model

    packed = load_model(str(tiny_llama_dir))
    inout = load_model(str(tiny_llama_dir), relayout="inout")
    bf16 = load_model(str(tiny_llama_dir), dtype="bfloat16")
    assert isinstance(packed.hf.lm_head, PackedLinear) and isinstance(inout.hf.lm_head, InOutLinear)
    assert not any(isinstance(m, PackedLinear) for m in bf16.hf.modules())
    assert packed.vocab_size == inout.vocab_size
    ids = torch.tensor([[5, 17, 33, 9, 2]])
    with torch.no_grad():
        a = packed.forward(ids, packed.new_cache()).logits
        b = inout.forward(ids, inout.new_cache()).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_kernel_compiles_into_a_fresh_cache_and_degrades_without_gxx(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a"))
    fresh = packed_gemm.load_kernel.__wrapped__()
    assert fresh is not None and list((tmp_path / "a" / "byblock" / "kernels").glob("packed_gemm-*.so"))
    w = torch.randn(20, 9)
    assert torch.equal(PackedLinear(w, None, fresh)(torch.ones(1, 9)), PackedLinear(w, None, kernel)(torch.ones(1, 9)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    from byblock.kernels import build

    monkeypatch.setattr(build.shutil, "which", lambda _: None)
    assert packed_gemm.load_kernel.__wrapped__() is None
    from byblock.kernels import quant_gemm

    assert quant_gemm.load_quant_kernel.__wrapped__() is None  # the same builder: no g++, no kernel


@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (150, 37), (17, 64), (49152 // 64, 576)])
def test_avx512_build_is_bitwise_the_avx2_build(n, k):
    """The AVX-512 build's many-rows path (16-lane registers, 12 rows x 2 panels per pass, row blocks) computes
    every output by the same FMA chain over k: bit for bit the AVX2 build, at every row count."""
    from byblock.kernels.cpu_features import cpu_flags

    if "avx512f" not in (cpu_flags() or frozenset()):
        pytest.skip("this CPU has no AVX-512")
    a2, a5 = load_kernel("avx2"), load_kernel("avx512")
    if a2 is None or a5 is None:
        pytest.skip("byblock's packed GEMM does not build here")
    assert (a2.isa, a5.isa) == ("avx2", "avx512")
    torch.manual_seed(0)
    w, b = torch.randn(n, k), torch.randn(n)
    l2, l5 = PackedLinear(w, b, a2), PackedLinear(w, b, a5)
    for m in (1, 2, 5, 15, 16, 17, 24, 95, 96, 97, 200, 300):
        x = torch.randn(m, k)
        assert torch.equal(l2(x), l5(x)), m
