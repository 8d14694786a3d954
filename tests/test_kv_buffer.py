"""The preallocated KV layer and the GQA SDPA attention are exact replacements of transformers' own."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from byblock.kernels.gqa_sdpa import gqa_sdpa_attention_forward
from byblock.kernels.ragged import PROMPT_KWARG
from byblock.kv.kv_buffer import BufferedLayer


def _same(a: BufferedLayer, b: DynamicLayer) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_buffered_layer_tracks_a_dynamic_layer_through_every_operation():
    """Appends (growing past the capacity), crops, slot compaction, leading-slot drops, gathers and batch
    selection, in a random order: the buffered layer always holds exactly what the concatenating one holds."""
    g = torch.Generator().manual_seed(0)
    ours, ref = BufferedLayer(), DynamicLayer()
    batch, heads, dim = 3, 2, 8

    def kv(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, heads, t, dim, generator=g), torch.randn(batch, heads, t, dim, generator=g)

    for step in range(60):
        op = int(torch.randint(6, (1,), generator=g)) if step > 2 else 0
        n = ref.get_seq_length()
        if op <= 1 or n < 4:
            k, v = kv(int(torch.randint(1, 200, (1,), generator=g)))
            got, want = ours.update(k, v), ref.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif op == 2:  # KVCache.crop
            keep = int(torch.randint(1, n, (1,), generator=g))
            for layer in (ours, ref):
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
        elif op == 3:  # KVCache.keep: a tree's accepted path after a kept prefix, or any increasing subset
            prefix = int(torch.randint(0, n, (1,), generator=g)) if step % 2 else 0
            rest = torch.randperm(n - prefix, generator=g)[: max(1, (n - prefix) // 2)].sort().values + prefix
            slots = torch.cat([torch.arange(prefix), rest])
            ptr = ours.keys.data_ptr()
            ours.select(slots)
            assert ours.keys.data_ptr() == ptr  # moved within its buffer
            ref.keys, ref.values = ref.keys.index_select(-2, slots), ref.values.index_select(-2, slots)
        elif op == 4:  # continuous batching: drop the leading slots every row has as padding
            lead = int(torch.randint(1, n, (1,), generator=g))
            for layer in (ours, ref):
                layer.keys, layer.values = layer.keys[..., lead:, :], layer.values[..., lead:, :]
        elif step % 3:  # H2O / SnapKV: a per-head gather
            idx = torch.stack([torch.randperm(n, generator=g)[: n // 2].sort().values for _ in range(heads)])
            idx = idx[None, :, :, None].expand(batch, -1, -1, dim)
            for layer in (ours, ref):
                layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
        else:  # the assignment path of KVCache.keep for other layers
            slots = torch.randperm(n, generator=g)[: max(1, n // 2)].sort().values
            for layer in (ours, ref):
                layer.keys, layer.values = layer.keys.index_select(-2, slots), layer.values.index_select(-2, slots)
        _same(ours, ref)
    rows = torch.tensor([0, 2])
    ours.batch_select_indices(rows)
    ref.batch_select_indices(rows)
    _same(ours, ref)
    batch = 2
    k, v = kv(5)
    ours.update(k, v), ref.update(k, v)
    _same(ours, ref)


def test_buffered_crop_is_a_view_not_a_copy():
    layer = BufferedLayer()
    layer.update(torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8))
    ptr = layer.keys.data_ptr()
    layer.keys = layer.keys[..., :10, :]
    assert layer.get_seq_length() == 10 and layer.keys.data_ptr() == ptr
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    assert layer.keys.data_ptr() == ptr  # appended in place, within the same buffer


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("case", ["decode", "decode_masked", "verify_bool", "verify_additive", "prefill"])
def test_gqa_sdpa_equals_transformers_sdpa_bitwise(groups, case):
    """Same output bits as transformers' SDPA backend (which repeats K/V when a mask is given) for prompt rows."""
    g = torch.Generator().manual_seed(groups)
    past, t = (0, 12) if case == "prefill" else (37, 1 if case.startswith("decode") else 9)
    q = torch.randn(2, 3 * groups, t, 16, generator=g)
    k = torch.randn(2, 3, past + t, 16, generator=g)
    v = torch.randn(2, 3, past + t, 16, generator=g)
    allowed = torch.ones(t, past + t, dtype=torch.bool)
    allowed[:, past:] = torch.ones(t, t, dtype=torch.bool).tril()
    allowed[:, 5] = False  # a padded or evicted slot
    mask = {
        "decode": None,
        "decode_masked": allowed[None, None],
        "verify_bool": allowed[None, None],
        "verify_additive": torch.zeros(1, 1, t, past + t).masked_fill(~allowed, torch.finfo(torch.float32).min),
        "prefill": None,
    }[case]
    module = _Attn(groups)
    # Prompt rows take the SDPA path, bitwise transformers'; rows with a past otherwise take the row-local kernel
    # (kernels/row_attention.py), the same values to fp32 tolerance.
    got, _ = gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=0.25, **{PROMPT_KWARG: True})
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (2, t, 3 * groups, 16)
    assert torch.equal(got, want)
    rows, _ = gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(rows, want, atol=2e-6, rtol=1e-5)
