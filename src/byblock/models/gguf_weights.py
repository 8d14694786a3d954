"""A GGUF's quantized blocks as byblock's int4 / int8 linears, without re-quantizing anything.

Supported block types map exactly onto `kernels/quant_gemm.py`'s layout (w = scale * q + min per group of 32):
Q4_0 (min = -8 d), Q4_1, Q4_K (scale = d * sc, min = -dmin * m per 32-element sub-block) and Q8_0. Every tensor
is checked against the de-quantized checkpoint the model was loaded from (the GGUF's own de-quantizer): its
de-quantized values must match that module's weight bit for bit, rows permuted where the converter permuted
them (llama's Q/K rotary layout), or the module keeps its float weight. Other types (Q5_K, Q6_K, F16, ...)
stay float.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from byblock.kernels.fuse import SIDE_BY_SIDE
from byblock.kernels.quant_embedding import QuantEmbedding
from byblock.kernels.quant_gemm import GROUP, PANEL, QuantGemm, QuantLinear, QuantWeight
from byblock.models.host_memory import drop_mapped_pages

log = logging.getLogger("byblock")

SUPPORTED = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")


def _f16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


Decoded = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]  # bits, values, scale, minv


def decode_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> Decoded:
    """One tensor's raw GGUF rows [n, bytes] -> (bits, values [n, k], scale [n, k/32], minv [n, k/32] or None)."""
    g = k // GROUP
    if kind == "Q8_0":
        b = raw.reshape(n, g, 34)
        return 8, torch.from_numpy(b[..., 2:].copy().view(np.int8)).reshape(n, k), _f16(b[..., :2]).reshape(n, g), None
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        b = raw.reshape(n, g, head + 16)
        qs = torch.from_numpy(b[..., head:].copy())  # byte j: element j (low nibble), j + 16 (high)
        values = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)
        d = _f16(b[..., :2]).reshape(n, g)
        minv = -8 * d if kind == "Q4_0" else _f16(b[..., 2:4]).reshape(n, g)
        return 4, values, d, minv
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)  # per 256 elements: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 qs
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each, one per 32-element sub-block
        qs = torch.from_numpy(blocks[:, 16:].copy()).reshape(-1, 4, 32)  # chunk c: sub-blocks 2c (low), 2c + 1
        values = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, k)
        scale = (d * torch.from_numpy(sc.astype(np.float32)).reshape(-1, 8)).reshape(n, g)
        minv = -(dmin * torch.from_numpy(mn.astype(np.float32)).reshape(-1, 8)).reshape(n, g)
        return 4, values, scale, minv
    raise ValueError(f"unsupported GGUF block type {kind}")


def _row_permutation(found: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
    """Indices p with found[p] == want row for row (bitwise), or None where some row has no match."""
    index = {row.tobytes(): i for i, row in enumerate(found.numpy())}
    perm = [index.get(row.tobytes()) for row in want.numpy()]
    return None if any(p is None for p in perm) else torch.tensor(perm)


@dataclass
class GgufReport:
    """What `quantize_from_gguf` did, for the log and `byblock bench`'s description."""

    kept: dict[str, str] = field(default_factory=dict)  # module name -> GGUF block type, as loaded
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> why it stays float
    embedding: str | None = None  # the kept head whose blocks are the input embedding's table, bitwise (tied)

    def summary(self) -> str:
        """One line: how many linears run on their GGUF blocks, by type, and how many stay float."""
        kinds: dict[str, int] = {}
        for kind in self.kept.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        held = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "none"
        return f"GGUF blocks kept: {held}; float: {len(self.skipped)}"


def _tensor_names(reader, n_layers: int):
    import gguf

    arch_field = reader.fields["general.architecture"]
    arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode()
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {arch_name!r} is unknown to the gguf package")
    return gguf.get_tensor_name_map(arch, n_layers)


def quantize_from_gguf(model: nn.Module, gguf_path: Path, kernel: QuantGemm | None, n_layers: int) -> GgufReport:
    """Replace each float nn.Linear of `model` whose GGUF tensor is a supported block type by a QuantLinear on
    those blocks (exact: checked against the module's weight). Returns what was kept and what was not."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    names = _tensor_names(reader, n_layers)
    report = GgufReport()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for module_name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        base = names.get_name(module_name)
        tensor = tensors.get(f"{base}.weight") if base else None
        if tensor is None and module is head:  # a tied head is the token embedding
            tensor = tensors.get("token_embd.weight")
        if tensor is None:
            report.skipped[module_name] = "no GGUF tensor"
            continue
        kind = tensor.tensor_type.name
        n, k = module.weight.shape
        if kind not in SUPPORTED or k % GROUP:
            report.skipped[module_name] = kind
            continue
        bits, values, scale, minv = decode_blocks(kind, np.asarray(tensor.data), n, k)
        qweight = QuantWeight.from_values(bits, values, scale, minv)
        want = module.weight.detach().float()
        found = qweight.dequantize()
        if not torch.equal(found, want):
            perm = _row_permutation(found, want)
            if perm is None:
                report.skipped[module_name] = f"{kind} (values differ from the checkpoint)"
                continue
            qweight = qweight.take_rows(perm)
        _install(model, module_name, qweight, kernel)
        report.kept[module_name] = kind
        if module is not head:  # the check read its fp32 pages; the (tied) head's are the embedding's too
            drop_mapped_pages(module.weight)
        if module is head and type(embedding) is nn.Embedding and torch.equal(found, embedding.weight):
            report.embedding = module_name  # tied: the lookup can read the head's blocks (QuantEmbedding)
    return report


CACHE_NAME = "gguf-linears-v4.safetensors"  # bump the version when the kernel layout or the grouping changes


def _install(model: nn.Module, name: str, qweight: QuantWeight, kernel: QuantGemm | None) -> None:
    module = model.get_submodule(name)
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, QuantLinear(qweight, module.bias, kernel))


def _groups(kept: dict[str, tuple[str, int, int]]) -> list[list[str]]:
    """The kept linears as storage groups: siblings the decoder fuses (kernels/fuse.py SIDE_BY_SIDE) together
    where they share a bit width and all but the last fill whole panels, every other linear alone."""
    groups, grouped = [], set()
    for name in kept:
        parent, _, attr = name.rpartition(".")
        for siblings in SIDE_BY_SIDE:
            if attr != siblings[0]:
                continue
            members = [f"{parent}.{s}" if parent else s for s in siblings]
            fits = all(m in kept for m in members) and len({kept[m][1] for m in members}) == 1
            if fits and all(kept[m][2] % PANEL == 0 for m in members[:-1]):
                groups.append(members)
                grouped.update(members)
    return groups + [[name] for name in kept if name not in grouped]


def _save_cache(model: nn.Module, report: GgufReport, cache: Path) -> None:
    """Write the kept linears' blocks, each group's tensors concatenated (so its members load as views of one
    storage and fusing them copies nothing, mapped straight from the file)."""
    from safetensors.torch import save_file

    kept = {}
    for name in report.kept:
        w = model.get_submodule(name).qweight
        kept[name] = (report.kept[name], w.bits, w.out_features)
    tensors = {}
    for members in _groups(kept):
        parts = [model.get_submodule(m).qweight for m in members]
        key = "+".join(members)
        tensors[f"{key}.q"] = torch.cat([w.q for w in parts])
        tensors[f"{key}.scale"] = torch.cat([w.scale for w in parts])
        if parts[0].minv is not None:
            tensors[f"{key}.minv"] = torch.cat([w.minv for w in parts])
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
    meta = {"kept": kept, "skipped": report.skipped, "embedding": report.embedding}
    save_file(tensors, str(tmp), metadata={"byblock": json.dumps(meta)})
    os.replace(tmp, cache)  # atomic: a killed run never leaves half a cache
    for old in cache.parent.glob("gguf-linears-v*.safetensors"):
        if old.name != cache.name:
            old.unlink(missing_ok=True)  # an older layout's cache: never read again


def load_gguf_linears(
    model: nn.Module, gguf_path: Path, cache_dir: Path, kernel: QuantGemm | None, n_layers: int
) -> GgufReport:
    """`quantize_from_gguf` with its result cached in `cache_dir` (built and checked once, then read back)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    cache = cache_dir / CACHE_NAME
    if not cache.is_file():
        _save_cache(model, quantize_from_gguf(model, gguf_path, kernel, n_layers), cache)
    with safe_open(str(cache), "pt") as f:
        meta = json.loads(f.metadata()["byblock"])
    kept = {name: tuple(v) for name, v in meta["kept"].items()}
    tensors = load_file(str(cache))  # mapped: pages are read as the kernels first touch them
    for members in _groups(kept):
        key = "+".join(members)
        panels = [-(-kept[m][2] // PANEL) for m in members]
        qs, scales = tensors[f"{key}.q"].split(panels), tensors[f"{key}.scale"].split(panels)
        minvs = tensors[f"{key}.minv"].split(panels) if f"{key}.minv" in tensors else [None] * len(members)
        for m, q, scale, minv in zip(members, qs, scales, minvs, strict=True):
            _install(model, m, QuantWeight(kept[m][1], q, scale, minv, kept[m][2]), kernel)
    if meta.get("embedding"):
        old = model.get_input_embeddings()
        model.set_input_embeddings(QuantEmbedding(model.get_submodule(meta["embedding"]).qweight, old.padding_idx))
    return GgufReport({k: v[0] for k, v in kept.items()}, meta["skipped"], meta.get("embedding"))
