"""The row-op kernel (kernels/row_ops.py): RMSNorm and rotary per head, against float64, row-invariant."""

import pytest
import torch

from byblock.kernels.row_ops import load_row_ops, norm_rope, reference_norm_rope, torch_norm_rope

KERNEL = load_row_ops()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the row-op kernel does not build here")


def _case(m: int, heads: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, 2 * heads * k, generator=g) * 3  # a column slice of wider rows, as k of a fused k|v
    pos = torch.arange(m, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, k)[None]
    return wide[:, : heads * k], torch.randn(k, generator=g), pos.cos(), pos.sin()


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 1, 576), (11, 1, 576), (11, 9, 64), (300, 3, 64), (5, 2, 8)])
def test_kernel_matches_float64_and_torch(shape):
    """Norm only, norm + rotation, rotation only: within fp32 rounding of the float64 definition, as torch is."""
    x, w, cos, sin = _case(*shape, seed=sum(shape))
    heads = shape[1]
    for weight, c, s in ((w, None, None), (w, cos, sin), (None, cos, sin)):
        ref = reference_norm_rope(x, heads, weight, 1e-6, c, s)
        got = KERNEL(x, heads, weight, 1e-6, c, s)
        assert got.shape == ref.shape == (shape[0], heads, shape[2])
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-5)
        torch.testing.assert_close(torch_norm_rope(x, heads, weight, 1e-6, c, s), ref, rtol=2e-6, atol=2e-5)


@needs_kernel
def test_kernel_is_row_invariant():
    """A row's bits do not depend on the other rows of the call (the drafter's batched == solo needs it)."""
    x, w, cos, sin = _case(40, 3, 64, seed=7)
    whole = KERNEL(x, 3, w, 1e-5, cos, sin)
    for lo, hi in ((0, 1), (5, 6), (3, 17), (39, 40)):
        assert torch.equal(KERNEL(x[lo:hi], 3, w, 1e-5, cos[lo:hi], sin[lo:hi]), whole[lo:hi])
    big = torch.randn(2048, 64)  # large enough to run threaded
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = KERNEL(big, 1, w, 1e-5, None, None)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(threads, 2))
    try:
        assert torch.equal(KERNEL(big, 1, w, 1e-5, None, None), one)
    finally:
        torch.set_num_threads(threads)


def test_norm_rope_falls_back_to_torch_ops():
    """Where the kernel does not apply (bf16; heads of a size that is not a multiple of 8) the torch ops run."""
    x, w, cos, sin = _case(4, 2, 12, seed=3)
    torch.testing.assert_close(norm_rope(x, 2, w, 1e-6, cos, sin), reference_norm_rope(x, 2, w, 1e-6, cos, sin))
    xb = x.bfloat16()
    out = norm_rope(xb, 2, w.bfloat16(), 1e-6, cos.bfloat16(), sin.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference_norm_rope(x, 2, w, 1e-6, cos, sin), rtol=0.05, atol=0.1)


@needs_kernel
def test_kernel_rejects_bad_shapes():
    x, w, cos, sin = _case(4, 2, 64, seed=1)
    with pytest.raises(ValueError, match="cos / sin"):
        KERNEL(x, 2, w, 1e-6, cos[:3], sin[:3])
    with pytest.raises(ValueError, match="multiple of 8"):
        KERNEL(torch.randn(4, 12), 1, None, 1e-6, None, None)
