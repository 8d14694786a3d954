"""byblock's own decoder forward (models/decoder.py) against transformers' modules: with exact ops bitwise the
same logits, hidden states and KV caches for prefills, plain steps, verify chains, trees and packed batches; with
the default row kernel the same to fp32 rounding, and row-invariant."""

from __future__ import annotations

import pytest
import torch
from tiny import make_target

from byblock.models.adapter import SegmentInput, TargetModel
from byblock.models.decoder import DecoderForward, DecoderOps

VARIANTS = ["llama-packed", "qwen3-packed", "llama-int4", "qwen3-int8", "llama-library"]


def pair(variant: str, exact: bool = True) -> tuple[TargetModel, TargetModel]:
    """(own forward, transformers' modules) over one model; exact: the decoder's torch ops (bitwise), else its
    default row kernel."""
    arch, _, linears = variant.partition("-")
    weights = linears if linears.startswith("int") else None
    base = make_target(arch, packed=linears == "packed", weights=weights)
    if linears == "library":  # library fp32 linears, byblock's attention kernel
        from byblock.kernels.gqa_sdpa import enable_gqa_sdpa

        enable_gqa_sdpa(base.hf)
    ours = TargetModel(base.hf, base.tokenizer, name=base.name, decoder_ops=DecoderOps(exact=exact))
    assert ours.decoder is not None
    return ours, TargetModel(base.hf, base.tokenizer, name=base.name, own_forward=False)


def same_caches(a, b) -> None:
    assert a.length == b.length and torch.equal(a.pos, b.pos)
    for la, lb in zip(a.hf.layers, b.hf.layers, strict=True):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("variant", VARIANTS)
@torch.inference_mode()
def test_own_forward_is_bitwise_transformers(variant):
    ours, ref = pair(variant)
    ca, cb = ours.new_cache(), ref.new_cache()
    layers = (0, 1)  # DFlash reads these; the last one is transformers' normed output
    steps = [
        dict(input_ids=torch.tensor([[5, 17, 33, 9, 2, 40, 41]])),  # prefill
        dict(input_ids=torch.tensor([[7]])),  # plain step
        dict(input_ids=torch.tensor([[8, 9, 10, 11]])),  # verify chain
        dict(  # a tree: root, two children, a grandchild
            input_ids=torch.tensor([[12, 13, 14, 15]]),
            positions=torch.tensor([[12, 13, 13, 14]]),
            tree_mask=torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool),
        ),
    ]
    for kwargs in steps:
        a = ours.forward(cache=ca, hidden_layers=layers, **kwargs)
        b = ref.forward(cache=cb, hidden_layers=layers, **kwargs)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
        same_caches(ca, cb)
    assert ref.defers_logits()  # transformers' path checks it once on a probe
    a = ours.forward(torch.tensor([[3]]), ca, defer_logits=True)
    b = ref.forward(torch.tensor([[3]]), cb, defer_logits=True)
    assert torch.equal(a.final, b.final)


@pytest.mark.parametrize("variant", ["llama-packed", "qwen3-int4"])
@torch.inference_mode()
def test_own_packed_forward_is_bitwise_transformers(variant):
    ours, ref = pair(variant)
    caches = {m: [m.new_cache(), m.new_cache()] for m in (ours, ref)}
    outs = {}
    for m, (c0, c1) in caches.items():
        m.forward(torch.tensor([[5, 6, 7]]), c1)  # one sequence already has a past
        segs = [SegmentInput(c0, [1, 2, 3, 4]), SegmentInput(c1, [8, 9])]
        outs[m] = m.forward_packed(segs, [3, 4, 5], hidden_layers=(0,), keep_final=True)
    a, b = outs[ours], outs[ref]
    assert torch.equal(a.logits, b.logits) and torch.equal(a.final, b.final) and torch.equal(a.hidden, b.hidden)
    for ca, cb in zip(caches[ours], caches[ref], strict=True):
        same_caches(ca, cb)


@pytest.mark.parametrize("variant", ["llama-int4", "qwen3-packed"])
@torch.inference_mode()
def test_row_kernel_forward_is_transformers_to_fp32_rounding_and_row_invariant(variant):
    """The default decoder (norms and rotations in kernels/row_ops.py) stays within fp32 rounding of transformers'
    modules, and a packed forward gives each segment bitwise what it gets alone (what losslessness rests on)."""
    ours, ref = pair(variant, exact=False)
    assert ours.decoder.row_ops is not None
    ca, cb = ours.new_cache(), ref.new_cache()
    for ids in ([[5, 17, 33, 9, 2, 40, 41]], [[7]], [[8, 9, 10, 11]]):
        a = ours.forward(torch.tensor(ids), ca, hidden_layers=(0, 1))
        b = ref.forward(torch.tensor(ids), cb, hidden_layers=(0, 1))
        assert torch.allclose(a.logits, b.logits, rtol=1e-4, atol=1e-4)
        assert torch.allclose(a.hidden, b.hidden, rtol=1e-4, atol=1e-4)
    alone = []
    for ids in ([1, 2, 3, 4], [8, 9]):
        c = ours.new_cache()
        ours.forward(torch.tensor([[5, 6, 7]]), c)
        alone.append(ours.forward(torch.tensor([ids]), c).logits[0])
    c0, c1 = ours.new_cache(), ours.new_cache()
    ours.forward(torch.tensor([[5, 6, 7]]), c0)
    ours.forward(torch.tensor([[5, 6, 7]]), c1)
    packed = ours.forward_packed([SegmentInput(c0, [1, 2, 3, 4]), SegmentInput(c1, [8, 9])], list(range(6)))
    assert torch.equal(packed.logits, torch.cat(alone))


def test_unsupported_models_keep_transformers_modules():
    gemma = make_target("gemma3", packed=True)  # sliding-window layers: not this forward's
    assert gemma.decoder is None
    bf16 = make_target("llama", dtype=torch.bfloat16)
    assert not DecoderForward.supports(bf16.hf)
    plain = make_target("llama")  # transformers' own sdpa attention: the decoder would not match it
    assert plain.decoder is None


def test_fused_projections_share_storage():
    ours, _ = pair("llama-int4")
    layer = ours.decoder.layers[0]
    assert layer.qkv is not None and layer.gate_up is not None
    q, qkv = layer.attn.q_proj, layer.qkv.module  # the decoder calls the fused linear bound (QuantGemm.bind)
    assert q.q.untyped_storage().data_ptr() == qkv.q.untyped_storage().data_ptr()
