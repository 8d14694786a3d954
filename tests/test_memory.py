"""Resident memory: what loading leaves mapped or paged in (deterministic checks, no RSS thresholds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import real_model_or_skip
from tiny import make_target

from byblock.drafters import DrafterSpec, build_drafter, shipped_dflash_dir
from byblock.drafters.costs import PROBE_ROWS, measure_segment_cost, measure_verify_cost


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_quantized_drafter_keeps_no_view_of_its_checkpoint():
    """Beside a quantized target the drafter's linears are re-quantized; no tensor of it may stay a view of the
    mapped checkpoint, or the fp32/bf16 pages the quantizer read stay resident beside the int8 copy."""
    target = real_model_or_skip()
    drafter = build_drafter(DrafterSpec.parse("dflash"), target)
    weights = shipped_dflash_dir(target.name) / "model.safetensors"
    ranges = _mapped_ranges(weights.resolve())
    tensors = list(drafter.model.state_dict().values())
    assert tensors
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in ranges)


def test_cost_probes_read_few_embedding_rows():
    """Timing forwards embed ids from a few hundred rows only: ids over the whole vocabulary would page the whole
    mapped embedding table in for nothing."""
    target = make_target()
    seen: list[torch.Tensor] = []
    forward = target.forward

    def spy(ids, *args, **kwargs):
        seen.append(ids)
        return forward(ids, *args, **kwargs)

    target.forward = spy
    measure_verify_cost(target, sizes=(1, 4), context=16, repeats=1)
    measure_segment_cost(target, segments=2, context=16, repeats=1)
    assert seen and max(int(ids.max()) for ids in seen) < 10 + PROBE_ROWS
