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


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_gguf_linears_stay_mapped_from_the_cache_fused_or_not():
    """Every quantized linear of the GGUF target — q / k / v and gate / up fused by the decoder included — is a
    view of the mapped blocks cache: fusing copied nothing (a copy would also leave the pages it read resident)."""
    from byblock.kernels.quant_gemm import QuantLinear
    from byblock.models.gguf_weights import CACHE_NAME

    target = real_model_or_skip()
    cache = Path(target.hf.name_or_path + ".quant") / CACHE_NAME
    ranges = _mapped_ranges(cache.resolve())
    assert ranges, "the blocks cache is not mapped"
    linears = [m for m in target.hf.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 211
    for m in linears:
        for t in (m.q, m.scale, m.minv):
            if t is not None:
                ptr = t.untyped_storage().data_ptr()
                assert any(lo <= ptr < hi for lo, hi in ranges)
    layer = target.hf.model.layers[0].self_attn
    assert layer.q_proj.q.untyped_storage().data_ptr() == layer.v_proj.q.untyped_storage().data_ptr()


@pytest.mark.parametrize("bits", [4, 8])
def test_fusing_side_by_side_parts_is_a_view_and_separate_parts_a_copy(bits):
    """fuse_linears: parts laid out side by side in one storage fuse as a view; separate parts are copied; both
    fused weights equal the parts stacked, bitwise."""
    from byblock.kernels.fuse import fuse_linears
    from byblock.kernels.quant_gemm import QuantLinear, QuantWeight, quantize

    torch.manual_seed(0)
    weights = [torch.randn(n, 64) for n in (32, 16, 16)]
    stacked = torch.cat(weights)
    whole = quantize(stacked, bits)
    spans = [2, 1, 1]  # panels of 16 outputs
    qs, scales = whole.q.split(spans), whole.scale.split(spans)
    minvs = whole.minv.split(spans) if whole.minv is not None else [None] * 3
    views = [
        QuantLinear(QuantWeight(bits, q, s, m, w.shape[0]), None, None)
        for q, s, m, w in zip(qs, scales, minvs, weights, strict=True)
    ]
    fused = fuse_linears(views)
    assert fused.q.untyped_storage().data_ptr() == whole.q.untyped_storage().data_ptr()
    assert torch.equal(fused.weight, whole.dequantize())
    separate = [QuantLinear(quantize(w, bits), None, None) for w in weights]
    own = [m.q.untyped_storage().data_ptr() for m in separate]
    copied = fuse_linears(separate)
    assert copied.q.untyped_storage().data_ptr() not in own
    assert {m.q.untyped_storage().data_ptr() for m in separate} == {copied.q.untyped_storage().data_ptr()}
    assert torch.equal(copied.weight, whole.dequantize())


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_are_the_dequantized_rows_bitwise(bits):
    """QuantWeight.rows reads a few outputs' blocks: bitwise `dequantize()[ids]`, repeats and padding panel too."""
    from byblock.kernels.quant_gemm import quantize

    torch.manual_seed(1)
    qw = quantize(torch.randn(40, 96), bits)  # 40 outputs: the last panel is partly padding
    ids = torch.tensor([0, 39, 17, 17, 16, 31, 32, 5])
    assert torch.equal(qw.rows(ids), qw.dequantize()[ids])


def test_tied_gguf_embedding_is_read_from_the_head_blocks():
    """SmolLM2's tied embedding is looked up from the head's Q8_0 blocks: the fp32 checkpoint's rows, bitwise."""
    from byblock.kernels.quant_embedding import QuantEmbedding, embed_rows
    from byblock.models.loading import load_model

    target = real_model_or_skip()
    embedding = target.hf.get_input_embeddings()
    assert isinstance(embedding, QuantEmbedding)
    head = target.hf.get_output_embeddings()
    assert embedding.qweight.q.untyped_storage().data_ptr() == head.q.untyped_storage().data_ptr()  # shared
    table = load_model("smollm2-135m", weights="fp32", relayout=False).hf.get_input_embeddings()
    ids = torch.tensor([[0, 1, 2, 49151], [7, 7, 300, 12345]])
    assert torch.equal(embedding(ids), table(ids))
    assert torch.equal(embed_rows(embedding, ids[0]), embed_rows(table, ids[0]))


def _status_mib(key: str = "VmRSS") -> float:
    """One memory line of /proc/self/status (VmRSS, RssFile, ...), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_release_freed_memory_returns_freed_heap_to_the_os():
    """Many small tensors freed stay in malloc's heap (RSS unchanged) until release_freed_memory hands them back."""
    from byblock.models.host_memory import _malloc_trim, release_freed_memory

    if _malloc_trim() is None:
        pytest.skip("no malloc_trim in this C library")
    release_freed_memory()
    base = _status_mib()
    blocks = [torch.ones(16 * 1024) for _ in range(2000)]  # 64 KiB each, below malloc's mmap threshold: ~125 MiB
    assert _status_mib() > base + 100
    keep = blocks[-1]  # the newest block stays: the freed ones lie below it, so only a trim of the heap's inside helps
    del blocks
    release_freed_memory()
    assert _status_mib() < base + 40
    del keep


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
def test_drop_mapped_pages_releases_a_mapped_tensor_and_leaves_heap_memory_alone(tmp_path):
    """A tensor mapped from a safetensors file: its read pages leave the process (the bytes stay the file's, read
    again on the next touch). A heap tensor: untouched, values intact."""
    from safetensors.torch import load_file, save_file

    from byblock.models.host_memory import drop_mapped_pages

    want = torch.arange(16 * 2**20, dtype=torch.float32)  # 64 MiB
    save_file({"w": want, "norm": torch.ones(8)}, str(tmp_path / "m.safetensors"))
    mapped = load_file(str(tmp_path / "m.safetensors"))
    assert float(mapped["w"].sum()) == float(want.sum())  # every page read: resident
    before = _status_mib("RssFile")
    drop_mapped_pages(mapped["w"])
    assert _status_mib("RssFile") < before - 50
    assert torch.equal(mapped["w"], want) and torch.equal(mapped["norm"], torch.ones(8))
    heap = want.clone()
    drop_mapped_pages(heap)
    assert torch.equal(heap, want)


def _mapping_rss_mib(path: Path) -> float:
    """Resident MiB of this process's mappings of `path`."""
    total, current = 0, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):
            current = fields[5] if len(fields) >= 6 else None
        elif fields and fields[0] == "Rss:" and current == str(path):
            total += int(fields[1])
    return total / 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc (Linux)")
def test_round_to_nearest_load_leaves_no_fp32_linear_pages_resident():
    """--weights int4 from the fp32 checkpoint: the linears it quantized were read in full; their pages go back
    as each is replaced (the checkpoint is 513 MiB, of which only the embedding rows in use need stay)."""
    from byblock.models.loading import load_model

    real_model_or_skip()  # the package is installed (and its checkpoint converted)
    target = load_model("smollm2-135m", weights="int4")
    ckpt = Path(target.hf.name_or_path).resolve() / "model.safetensors"
    assert _mapping_rss_mib(ckpt) < 150


@pytest.mark.real_model
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc (Linux)")
def test_first_conversion_leaves_no_fp32_checkpoint_resident(tmp_path, monkeypatch):
    """A first load converts the GGUF (an empty cache) and checks every block against the de-quantized fp32
    checkpoint, reading all of it: those pages go back as each linear is checked, not at exit."""
    from byblock.models.loading import load_model

    real_model_or_skip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = load_model("smollm2-135m")
    assert target.weights == "gguf (210 Q4_1, 1 Q8_0), int8 activations"
    ckpt = Path(target.hf.name_or_path).resolve()
    assert ckpt.is_relative_to(tmp_path)
    assert _mapping_rss_mib(ckpt / "model.safetensors") < 150


@pytest.mark.real_model
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc (Linux)")
def test_rss_breakdown_script_runs():
    """benchmarks/rss_breakdown.py (how RESULTS §12's memory items were found) stays runnable."""
    import subprocess
    import sys

    real_model_or_skip()
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "rss_breakdown.py"
    out = subprocess.run(
        [sys.executable, str(script), "--drafter", "none", "--tokens", "4", "--top", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    stages = [line.split()[0] for line in out.stdout.splitlines() if " RSS " in line]
    assert stages == ["start", "import", "import", "load_model", "answer"], out.stdout
