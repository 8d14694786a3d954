"""byblock's int4 / int8 weight-only kernels (kernels/quant_gemm.py: fp32 activations, csrc/quant_gemm.cpp; int8
activations, csrc/quant_dot.cpp) against their de-quantized references, row invariance at every row count, both
ISA builds, and the GGUF block decoders against the gguf package's own."""

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
    EXTRA_CPU_FLAGS,
    QuantLinear,
    QuantWeight,
    load_quant_kernel,
    quantize,
    quantize_activations,
)
from byblock.models.gguf_weights import decode_blocks

FLAGS = cpu_flags() or frozenset()
ISAS = {
    act: ["avx2"] + (["avx512"] if AVX512_CPU_FLAGS | EXTRA_CPU_FLAGS[act] <= FLAGS else []) for act in ("fp32", "int8")
}
KERNELS = [(act, isa) for act, isas in ISAS.items() for isa in isas]


def kernel_or_skip(kind):
    kernel = load_quant_kernel(kind[1], kind[0])
    if kernel is None:
        pytest.skip("the quantized GEMM does not build here (no g++ or no AVX2)")
    return kernel


def reference(kind, x: torch.Tensor, lin: QuantLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel stands for, in float64: the de-quantized weight times x (fp32 activations) or times x's
    int8 codes de-quantized (int8 activations)."""
    if kind[0] == "int8":
        codes, d, _ = quantize_activations(x)
        x = (codes.double().reshape(len(x), -1, 32) * d.double()[..., None]).reshape(x.shape)
    return F.linear(x.double(), lin.weight.double(), None if bias is None else bias.double()).float()


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(64, 32), (50, 96), (576, 576), (130, 1536)])  # N not a multiple of 16 too
def test_kernel_matches_dequantized_reference_and_is_row_invariant(kind, bits, shape):
    torch.manual_seed(0)
    n, k = shape
    weight = torch.randn(n, k) * 0.05
    bias = torch.randn(n)
    lin = QuantLinear(quantize(weight, bits), bias, kernel_or_skip(kind))
    x = torch.randn(33, k)
    with torch.inference_mode():
        y = lin(x)
        torch.testing.assert_close(y, reference(kind, x, lin, bias), rtol=1e-5, atol=1e-5)
        for m in (1, 2, 3, 5, 8, 9, 17):  # every row count gives each row bitwise its one-row result
            assert torch.equal(lin(x[:m]), y[:m]), m
        for i in range(0, 33, 7):
            assert torch.equal(lin(x[i : i + 1]), y[i : i + 1])


@pytest.mark.parametrize("act", ["fp32", "int8"])
@pytest.mark.parametrize("bits", [4, 8])
def test_avx2_and_avx512_builds_agree_bitwise(act, bits):
    """Lanes are outputs and never mix (and the int8 kernel's sums are exact integers), so both builds run the
    same arithmetic per output."""
    if len(ISAS[act]) < 2:
        pytest.skip("this CPU has no AVX-512 (with VNNI for the int8 kernel)")
    torch.manual_seed(1)
    qw = quantize(torch.randn(200, 320), bits)
    x = torch.randn(6, 320)
    outs = [QuantLinear(qw, None, kernel_or_skip((act, isa)))(x) for isa in ISAS[act]]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", [k for k in KERNELS if k[0] == "int8"])
def test_int8_activation_codes_are_the_reference_quantizer_bitwise(kind):
    """The kernel's per-group int8 codes and scales are torch's `quantize_activations`, bit for bit (ties,
    zeros, a whole zero group and outliers included), so the float64 reference above is the kernel's model."""
    torch.manual_seed(3)
    x = torch.randn(9, 128) * torch.logspace(-3, 2, 9)[:, None]
    x[0, :32] = 0.0
    x[1, 5] = 1e4
    x[2, :32] = torch.arange(32) - 15.5  # halves: rounding ties
    ours = kernel_or_skip(kind).quantize_activations(x)
    for a, b in zip(ours, quantize_activations(x), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [k for k in KERNELS if k[0] == "int8"])
@pytest.mark.parametrize("bits", [4, 8])
def test_int8_activations_stay_close_to_fp32_activations(kind, bits):
    """Quantizing the activations costs ~1 % relative error per output (llama.cpp's trade), not more; int8
    weights at the -128 edge are exact (the kernel's offset and nibble split cannot overflow)."""
    torch.manual_seed(4)
    qw = quantize(torch.randn(96, 256) * 0.05, bits)
    if bits == 8:
        values, scale, _ = qw.values()
        values[:, ::7] = -128
        qw = QuantWeight.from_values(8, values, scale, None)
    x = torch.randn(20, 256)
    lin = QuantLinear(qw, None, kernel_or_skip(kind))
    exact = F.linear(x.double(), lin.weight.double())
    with torch.inference_mode():
        y = lin(x).double()
    torch.testing.assert_close(y.float(), reference(kind, x, lin, None), rtol=1e-5, atol=1e-5)
    assert ((y - exact).norm() / exact.norm()).item() < 0.02


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


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K"])
def test_gguf_scales_are_fp16_where_the_file_holds_them(kind):
    """Q4_0 / Q4_1 / Q8_0 keep the file's fp16 d and m as fp16 (2 bytes a group less per output than fp32, the
    bytes llama.cpp streams); Q4_K's scales are products d * sc, not fp16 values, and stay fp32."""
    rng = np.random.default_rng(5)
    if kind == "Q4_K":
        raw = rng.integers(0, 256, size=(16, 2 * 144), dtype=np.uint8)
        halves = raw.reshape(-1, 144)[:, :4].copy().view(np.float16)
        halves[:] = rng.uniform(0.001, 0.05, size=halves.shape).astype(np.float16)
        raw.reshape(-1, 144)[:, :4] = halves.view(np.uint8)
        n, k = 16, 512
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize

        n, k = 48, 96
        raw = gguf_quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[kind])
    qw = QuantWeight.from_values(*decode_blocks(kind, raw, n, k))
    want = torch.float32 if kind == "Q4_K" else torch.float16
    assert qw.scale.dtype == want and (qw.minv is None or qw.minv.dtype == want)
    if kind == "Q4_1":
        assert qw.nbytes() == -(-n // 16) * 16 * (k // 32) * 20  # 16 code bytes + fp16 d and m per group


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_fp16_and_fp32_scales_of_the_same_values_give_the_same_bits(kind, bits):
    """The kernels convert fp16 scales exactly in registers: the compact layout and the fp32 one of the same
    values give bitwise the same outputs at every row count (so losslessness carries over unchanged)."""
    kernel = kernel_or_skip(kind)
    torch.manual_seed(6)
    qw = quantize(torch.randn(72, 160), bits)
    assert qw.scale.dtype == torch.float16
    wide = QuantWeight(bits, qw.q, qw.scale.float(), None if qw.minv is None else qw.minv.float(), 72)
    assert wide.nbytes() > qw.nbytes()
    for m in (1, 3, 13, 40):
        x = torch.randn(m, 160)
        assert torch.equal(kernel.linear(x, qw, None), kernel.linear(x, wide, None))
    assert torch.equal(QuantLinear(qw, None, kernel).weight, QuantLinear(wide, None, kernel).weight)


def test_the_quantizer_keeps_fp32_scales_where_fp16_would_lose_them():
    """Round-to-nearest rounds scales to fp16 (as llama.cpp stores them) only where every one is a normal fp16
    number: a group of huge or of tiny weights keeps fp32 scales, never an overflow or a subnormal's lost bits."""
    torch.manual_seed(7)
    w = torch.randn(16, 64)
    assert quantize(w, 4).scale.dtype == torch.float16
    for bits in (4, 8):
        for factor in (1e7, 1e-7):  # scales past fp16's range / below its smallest normal
            odd = w.clone()
            odd[3, :32] *= factor
            qw = quantize(odd, bits)
            assert qw.scale.dtype == torch.float32
            err = (qw.dequantize() - odd).abs().reshape(16, -1, 32)
            assert (err <= qw.values()[1][..., None] * 0.5001 + 1e-7 * factor).all()
    with pytest.raises(ValueError, match="both fp16 or both fp32"):
        qw = quantize(w, 4)
        QuantWeight(4, qw.q, qw.scale, qw.minv.float(), 16)


@pytest.mark.real_model
def test_real_gguf_keeps_every_block_exactly():
    """The built-in SmolLM2 GGUF: every linear on its Q4_1 / Q8_0 blocks, bitwise the fp32 checkpoint."""
    from byblock.models.loading import load_model

    real_model = real_model_or_skip()  # weights="auto": the GGUF's own blocks
    fp32 = load_model("smollm2-135m", weights="fp32", relayout=False)
    assert real_model.weights == "gguf (210 Q4_1, 1 Q8_0), int8 activations", real_model.weights
    # The blocks' cache lies beside the de-quantized checkpoint: vLLM loads every *.safetensors inside it.
    ckpt = real_model.hf.name_or_path
    assert [p.name for p in Path(ckpt).glob("*.safetensors")] == ["model.safetensors"], ckpt
    ours = dict(real_model.hf.named_modules())
    for name, module in fp32.hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            q = ours[name]
            assert isinstance(q, QuantLinear), name
            assert torch.equal(q.weight, module.weight), name


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_in_row_blocks_stay_row_invariant(kind, bits):
    """A prefill-sized call runs its rows in blocks (x stays in L2): each row is still bitwise its lone result."""
    torch.manual_seed(2)
    lin = QuantLinear(quantize(torch.randn(100, 192) * 0.05, bits), None, kernel_or_skip(kind))
    x = torch.randn(300, 192)
    with torch.inference_mode():
        y = lin(x)
        for lo, hi in ((0, 1), (127, 129), (128, 300), (5, 261), (299, 300)):
            assert torch.equal(lin(x[lo:hi]), y[lo:hi]), (lo, hi)


def test_unknown_activations_are_refused_before_loading(tmp_path):
    """load_model names the choices; the CLI flag is a one-line usage error (exit 2)."""
    import subprocess
    import sys

    from byblock.errors import ByblockError
    from byblock.models.loading import load_model

    with pytest.raises(ByblockError, match="unknown activations 'int4'; expected one of int8, fp32"):
        load_model("no-such-model", activations="int4")
    argv = [sys.executable, "-m", "byblock.cli.main", "generate", "hi", "--activations", "int4"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("bits", [4, 8])
def test_a_bound_linear_is_its_module_bitwise_and_follows_replaced_weights(bits):
    """QuantGemm.bind (the decoder's hot path) calls the kernel the module's forward calls, with the same bits, for
    1 and many rows and a bias; once the module's weights are replaced it takes the module's path instead of
    reading the old pointers."""
    kernel = kernel_or_skip(("int8", "avx2"))
    g = torch.Generator().manual_seed(0)
    lin = QuantLinear(quantize(torch.randn(40, 64, generator=g), bits), torch.randn(40, generator=g), kernel)
    call = kernel.bind(lin)
    for rows in (1, 5):
        x = torch.randn(2, rows, 64, generator=g)
        assert torch.equal(call(x), lin(x))
    lin.q = quantize(torch.randn(40, 64, generator=g), bits).q  # new weights of the same layout
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(call(x), lin(x))
