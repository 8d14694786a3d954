"""byblock's int4 / int8 weight-only kernels (kernels/quant_gemm.py) against their de-quantized reference, row
invariance at every row count, both ISA builds, and the GGUF block decoders against the gguf package's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import real_model_or_skip

from byblock.kernels.cpu_features import cpu_flags
from byblock.kernels.quant_gemm import (
    AVX512_CPU_FLAGS,
    QuantLinear,
    QuantWeight,
    load_quant_kernel,
    quantize,
)
from byblock.models.gguf_weights import decode_blocks

ISAS = ["avx2"] + (["avx512"] if (cpu_flags() or frozenset()) >= AVX512_CPU_FLAGS else [])


def kernel_or_skip(isa: str):
    kernel = load_quant_kernel(isa)
    if kernel is None:
        pytest.skip("the quantized GEMM does not build here (no g++ or no AVX2)")
    return kernel


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(64, 32), (50, 96), (576, 576), (130, 1536)])  # N not a multiple of 16 too
def test_kernel_matches_dequantized_reference_and_is_row_invariant(isa, bits, shape):
    torch.manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k) * 0.05
    bias = torch.randn(n)
    lin = QuantLinear(quantize(weight, bits), bias, kernel_or_skip(isa))
    x = torch.randn(33, k)
    with torch.inference_mode():
        y = lin(x)
        ref = F.linear(x.double(), lin.weight.double(), bias.double()).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        for m in (1, 2, 3, 5, 8, 9, 17):  # every row count gives each row bitwise its one-row result
            assert torch.equal(lin(x[:m]), y[:m]), m
        for i in range(0, 33, 7):
            assert torch.equal(lin(x[i : i + 1]), y[i : i + 1])


@pytest.mark.skipif(len(ISAS) < 2, reason="this CPU has no AVX-512")
@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_and_avx512_builds_agree_bitwise(bits):
    """Lanes are outputs and never mix, so both builds run the same arithmetic per output."""
    torch.manual_seed(1)
    qw = quantize(torch.randn(200, 320), bits)
    x = torch.randn(6, 320)
    outs = [QuantLinear(qw, None, kernel_or_skip(isa))(x) for isa in ISAS]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("bits", [4, 8])
def test_layout_roundtrip_and_row_selection(bits):
    torch.manual_seed(2)
    w = torch.randn(37, 64)
    qw = quantize(w, bits)
    values, scale, minv = qw.values()
    again = QuantWeight.from_values(bits, values, scale, minv)
    assert torch.equal(again.q, qw.q) and torch.equal(again.dequantize(), qw.dequantize())
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(qw.take_rows(rows).dequantize(), qw.dequantize()[rows])
    err = (qw.dequantize() - w).abs().reshape(37, -1, 32)
    assert (err <= scale[..., None] * 0.5001 + 1e-7).all()  # round to nearest: half a step at most


def test_bad_layouts_are_refused():
    qw = quantize(torch.randn(16, 32), 4)
    with pytest.raises(ValueError, match="bits"):
        QuantWeight(3, qw.q, qw.scale, qw.minv, 16)
    with pytest.raises(ValueError, match="int4 needs"):
        QuantWeight(4, qw.q, qw.scale, None, 16)
    with pytest.raises(ValueError, match="panels"):
        QuantWeight(4, qw.q, qw.scale, qw.minv, 40)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_decode_to_the_gguf_dequantizer_bitwise(kind):
    """byblock's layout holds exactly the values the GGUF's own de-quantizer gives (what the checkpoint holds)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = gguf_quantize(w, qtype)
    ref = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
    bits, values, scale, minv = decode_blocks(kind, raw, 48, 96)
    assert torch.equal(QuantWeight.from_values(bits, values, scale, minv).dequantize(), ref)


def test_q4_k_blocks_decode_to_the_gguf_dequantizer_bitwise():
    """Q4_K has no quantizer in the gguf package: random super-blocks, decoded by both."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(3)
    n, k = 16, 512
    raw = rng.integers(0, 256, size=(n, k // 256 * 144), dtype=np.uint8)
    halves = raw.reshape(-1, 144)[:, :4].copy().view(np.float16)  # keep d, dmin finite and modest
    halves[:] = rng.uniform(0.001, 0.05, size=halves.shape).astype(np.float16)
    raw.reshape(-1, 144)[:, :4] = halves.view(np.uint8)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float32)).reshape(n, k)
    bits, values, scale, minv = decode_blocks("Q4_K", raw, n, k)
    assert torch.equal(QuantWeight.from_values(bits, values, scale, minv).dequantize(), ref)


@pytest.mark.real_model
def test_real_gguf_keeps_every_block_exactly():
    """The built-in SmolLM2 GGUF: every linear on its Q4_1 / Q8_0 blocks, bitwise the fp32 checkpoint."""
    from byblock.models.loading import load_model

    real_model = real_model_or_skip()  # weights="auto": the GGUF's own blocks
    fp32 = load_model("smollm2-135m", weights="fp32", relayout=False)
    assert real_model.weights.startswith("gguf (210 Q4_1, 1 Q8_0)")
    # The blocks' cache lies beside the de-quantized checkpoint: vLLM loads every *.safetensors inside it.
    ckpt = real_model.hf.name_or_path
    assert [p.name for p in Path(ckpt).glob("*.safetensors")] == ["model.safetensors"], ckpt
    ours = dict(real_model.hf.named_modules())
    for name, module in fp32.hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            q = ours[name]
            assert isinstance(q, QuantLinear), name
            assert torch.equal(q.weight, module.weight), name


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_in_row_blocks_stay_row_invariant(isa, bits):
    """A prefill-sized call runs its rows in blocks (x stays in L2): each row is still bitwise its lone result."""
    torch.manual_seed(2)
    lin = QuantLinear(quantize(torch.randn(100, 192) * 0.05, bits), None, kernel_or_skip(isa))
    x = torch.randn(300, 192)
    with torch.inference_mode():
        y = lin(x)
        for lo, hi in ((0, 1), (127, 129), (128, 300), (5, 261), (299, 300)):
            assert torch.equal(lin(x[lo:hi]), y[lo:hi]), (lo, hi)
