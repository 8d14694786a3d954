"""One entry point from a name to a ready TargetModel.

Accepted: a built-in name (see `byblock models`), a local checkpoint directory, a `.gguf` file, or a
Hugging Face repo id. A GGUF is de-quantized once (slow: tens of seconds) and cached as safetensors
under `$XDG_CACHE_HOME/byblock/models/`, so later loads take seconds.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from byblock.errors import ByblockError, ModelNotFoundError
from byblock.kernels.cpu_features import native_bf16
from byblock.kernels.fast_linear import dual_layout_linears, relayout_linears
from byblock.kernels.gqa_sdpa import enable_gqa_sdpa
from byblock.kernels.invariant import enable_row_invariance, probe_row_invariance
from byblock.kernels.packed_gemm import load_kernel, pack_linears
from byblock.kernels.quant_gemm import ACTIVATIONS, load_quant_kernel, quantize_linears
from byblock.models.adapter import TargetModel
from byblock.models.devices import DTYPES, WeightFormat, resolve_device, resolve_dtype, resolve_weights
from byblock.models.gguf_weights import load_gguf_linears
from byblock.models.host_memory import drop_mapped_pages, release_freed_memory
from byblock.models.registry import BUILTIN_MODELS, resolve_builtin

log = logging.getLogger(__name__)

__all__ = ["DTYPES", "cache_root", "load_model", "load_model_config", "load_tokenizer"]


def cache_root() -> Path:
    """byblock's cache directory (honours XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "byblock"


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub endpoint accepts a TCP connection (so a miss fails fast offline)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=32)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    """16 hex digits of the file's sha256 (memoised per path, size and mtime: ~0.2 s for 100 MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _gguf_cache_dir(gguf: Path) -> Path:
    """Where a GGUF's conversion is cached, keyed by the file's bytes: every virtualenv or clone that ships the
    same file shares one conversion (a key from the path gave each fresh clone's venv its own 0.5 GB copy)."""
    st = gguf.stat()
    key = _content_key(str(gguf.resolve()), st.st_size, st.st_mtime_ns)
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def prune_model_cache() -> tuple[list[Path], int]:
    """Delete cached conversions other than the installed built-ins' current ones, and unfinished temporaries.

    Returns the deleted directories and the bytes freed. A model whose conversion is deleted is converted
    again on its next load, so this loses no work a user cannot redo.
    """
    root = cache_root() / "models"
    if not root.is_dir():
        return [], 0
    keep: set[str] = set()
    for name, model in BUILTIN_MODELS.items():
        if model.installed():
            target = _gguf_cache_dir(resolve_builtin(name))
            keep |= {target.name, target.name + ".quant"}
    gone: list[Path] = []
    freed = 0
    for entry in sorted(root.iterdir()):
        if entry.name in keep or not entry.is_dir():
            continue
        freed += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        shutil.rmtree(entry, ignore_errors=True)
        gone.append(entry)
    return gone, freed


def publish_dir(tmp: Path, target: Path) -> None:
    """Rename a finished temporary directory into place. Two processes loading the same model for the first
    time both convert it; the second rename finds the first one's directory, which is just as good: keep it."""
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def dequantize_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF into a safetensors checkpoint directory once; return that directory.

    The GGUF's dequantized values are exact in float32, so the cache is stored in float32.
    Writes go to a temporary directory renamed into place, so a killed run never leaves half a cache.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = _gguf_cache_dir(gguf)
    if (target / "config.json").is_file():
        return target
    log.info("de-quantizing %s (once; cached at %s)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are now plain float tensors; drop the GGUF marker so the checkpoint saves as ordinary HF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        publish_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    del model, tok
    release_freed_memory()  # the de-quantized fp32 model (0.5 GB for SmolLM2), before the checkpoint is loaded
    return target


def gguf_source(name_or_path: str) -> Path | None:
    """The GGUF file a model reference loads from (a built-in's or a .gguf path), or None."""
    if name_or_path in BUILTIN_MODELS:
        return resolve_builtin(name_or_path)
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_checkpoint(name_or_path: str) -> str:
    """Map a user-given model reference to something `from_pretrained` can open."""
    if name_or_path in BUILTIN_MODELS:
        return str(dequantize_gguf(resolve_builtin(name_or_path)))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return str(dequantize_gguf(path))
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
        return str(path)
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        return name_or_path  # a hub id: from_pretrained resolves it (local hub cache first)
    known = ", ".join(BUILTIN_MODELS)
    raise ModelNotFoundError(f"unknown model '{name_or_path}': not a built-in ({known}), path or hub id")


def _first_line(e: Exception) -> str:
    """A loader exception as one line (transformers' messages run to paragraphs)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _load_part(what: str, auto_class, name_or_path: str, trust_remote_code: bool):
    """One piece of a checkpoint (tokenizer, config) without its weights; errors as one line."""
    _quiet_transformers()
    ckpt = resolve_checkpoint(name_or_path)
    try:
        return auto_class.from_pretrained(
            ckpt, local_files_only=not Path(ckpt).exists(), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot load the {what} of '{name_or_path}': {_first_line(e)}") from e


def load_tokenizer(name_or_path: str = "smollm2-135m", *, trust_remote_code: bool = False):
    """Only the tokenizer of a model reference (same resolution as load_model, no weights loaded)."""
    from transformers import AutoTokenizer

    return _load_part("tokenizer", AutoTokenizer, name_or_path, trust_remote_code)


def load_model_config(name_or_path: str = "smollm2-135m", *, trust_remote_code: bool = False):
    """Only the transformers config of a model reference (same resolution as load_model, no weights loaded)."""
    from transformers import AutoConfig

    return _load_part("config", AutoConfig, name_or_path, trust_remote_code)


def load_model(
    name_or_path: str = "smollm2-135m",
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    relayout: bool | str = True,
    row_invariant: bool | None = None,
    weights: str = "auto",
    activations: str = "int8",
) -> TargetModel:
    """Load a causal LM and its tokenizer as a TargetModel.

    Args:
        name_or_path: built-in name, checkpoint dir, .gguf file or hub id.
        device: "auto" (CUDA when a GPU is visible, else the CPU), "cpu", "cuda" or "cuda:N". Kernels are chosen
            by it: byblock's packed fp32 GEMM, the [in, out] layouts, GQA SDPA and the bf16 row-invariance rules
            are CPU kernels and apply on the CPU only; elsewhere transformers' own (portable) modules run.
        dtype: weights dtype: "auto" (bfloat16 on CUDA, float32 on the CPU), "float32" or "bfloat16".
        trust_remote_code: allow code shipped with a hub checkpoint to run (off unless asked).
        attn_implementation: transformers attention backend ("sdpa" or "eager").
        relayout: True: the fastest float linears available: for float32 byblock's packed-panel GEMM
            (kernels/packed_gemm.py; fast and row-invariant at any row count) where it compiles, else weights
            stored [in, out] for faster CPU GEMV ("inout", kernels/fast_linear.py); "dual": both library
            layouts, the kernel picked by row count; "packed": the packed GEMM or an error; False: as loaded
            (with `weights="auto"`, floats too).
        row_invariant: make decode and verify forwards compute each token's logits bitwise independently of
            how many tokens share the forward, so speculative decoding is token-identical to plain decoding
            (kernels/invariant.py; replaces `relayout`). None: on for bfloat16 on the CPU, whose kernels need it;
            off elsewhere (a GPU's library kernels are not row-invariant: greedy speculative output then equals
            plain greedy output except at near-ties, see docs/devices.md).
        weights: how linears store their weights (models/devices.py WeightFormat): "auto" (a GGUF's own blocks
            where the model comes from a GGUF and runs on the CPU in float32, else floats), "fp32" / "bf16"
            (floats of that dtype), "int8" / "int4" (round-to-nearest groups of 32) or "gguf" (the file's
            Q4_0 / Q4_1 / Q4_K / Q8_0 blocks as they are; other types stay float). Quantized linears run
            byblock's row-invariant int4 / int8 kernels (kernels/quant_gemm.py).
        activations: how quantized linears take their inputs: "int8" (each row quantized per group of 32 and
            summed in integers, llama.cpp's recipe: fastest, within ~1 % of the float product) or "fp32" (the
            weights converted to float: the de-quantized weight's product to fp32 tolerance, slower once a
            call has more than a few rows). Both are row-invariant, so speculative output equals plain output.
    """
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    on_cpu = device.type == "cpu"
    if row_invariant and not on_cpu:
        raise ByblockError("row-invariant kernels are CPU kernels; on a GPU load with row_invariant=None or False")
    if relayout == "packed" and not on_cpu:
        raise ByblockError("--linears packed is a CPU kernel; on a GPU use --linears auto or library")
    if on_cpu and dtype == torch.bfloat16 and not native_bf16():
        log.warning(
            "warning: this CPU has no native bf16 (AVX512-BF16 / AMX): bf16 is emulated and runs slower than "
            "--dtype float32 here"
        )
    source = gguf_source(name_or_path)
    if activations not in ACTIVATIONS:
        raise ByblockError(f"unknown activations {activations!r}; expected one of {', '.join(ACTIVATIONS)}")
    quant_kernel = load_quant_kernel(activations=activations) if on_cpu else None
    if relayout is False and weights == "auto":
        weights = "fp32" if dtype == torch.float32 else "bf16"  # "as loaded": the checkpoint's floats
    fmt = resolve_weights(
        weights, dtype, device, from_gguf=source is not None, kernel_available=quant_kernel is not None
    )
    if fmt.quantized and quant_kernel is None:
        log.warning("warning: byblock's quantized kernels do not build here (no g++ or AVX2); %s runs slowly", fmt)
    ckpt = resolve_checkpoint(name_or_path)
    is_hub = not Path(ckpt).exists()
    kwargs = {"trust_remote_code": trust_remote_code}
    try:
        try:
            tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=is_hub, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=dtype, attn_implementation=attn_implementation, local_files_only=is_hub, **kwargs
            )
        except OSError:
            if not is_hub or os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            if not _hub_reachable():
                raise ModelNotFoundError(
                    f"model '{name_or_path}' is not in the local hub cache and the hub cannot be reached"
                ) from None
            tok = AutoTokenizer.from_pretrained(ckpt, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, dtype=dtype, attn_implementation=attn_implementation, **kwargs
            )
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"cannot load model '{name_or_path}': {_first_line(e)}") from e
    if not on_cpu:  # the portable path: transformers' modules with the device's library kernels
        return TargetModel(model.to(device).eval(), tok, name=name_or_path)
    release = _page_releaser(model)
    described = _quantize(model, fmt, source, Path(ckpt), quant_kernel, release) if fmt.quantized else str(dtype)[6:]
    if fmt.quantized:
        described += f", {activations} activations"
    if row_invariant is None:
        row_invariant = dtype == torch.bfloat16
    if row_invariant:
        enable_row_invariance(model)
        for failure in probe_row_invariance(model):
            log.warning(
                "warning: row invariance does not hold on this CPU (%s): bf16 speculative decoding may not be "
                "token-identical to plain decoding here; --dtype float32 avoids bf16's near-ties",
                failure,
            )
    else:
        if attn_implementation == "sdpa":
            enable_gqa_sdpa(model)  # masked verify forwards without repeat_kv copies (kernels/gqa_sdpa.py)
        if relayout == "dual":
            dual_layout_linears(model)
        elif relayout in (True, "packed") and dtype == torch.float32 and (kernel := load_kernel()) is not None:
            pack_linears(model, kernel, release)
        elif relayout == "packed":
            raise ByblockError("--linears packed needs float32 weights, g++ and an AVX2 CPU (kernels/packed_gemm.py)")
        elif relayout:
            relayout_linears(model)
    target = TargetModel(model.eval(), tok, name=name_or_path, weights=described)
    release_freed_memory()  # loading's and re-layout's temporaries
    return target


def _page_releaser(model: nn.Module) -> Callable[[nn.Linear], None]:
    """What quantization / packing call with each linear they replace: its weight is a view of the mapped
    checkpoint, which the embedding and norms keep open, so every page the conversion read would stay resident
    beside the converted copy (fp32 SmolLM2: 513 MiB beside int4's 60). A tied weight (the head that is also the
    input embedding) stays."""
    counts = Counter(p.untyped_storage().data_ptr() for _, p in model.named_parameters(remove_duplicate=False))

    def release(linear: nn.Linear) -> None:
        if counts.get(linear.weight.untyped_storage().data_ptr(), 0) == 1:
            drop_mapped_pages(linear.weight)

    return release


def _quantize(
    model, fmt: WeightFormat, source: Path | None, ckpt: Path, kernel, release: Callable[[nn.Linear], None]
) -> str:
    """Quantize `model`'s linears in place as `fmt` asks; returns a description ("gguf: 210 Q4_1, 1 Q8_0")."""
    n_layers = model.config.get_text_config().num_hidden_layers
    if fmt is WeightFormat.GGUF:
        assert source is not None
        # Beside the checkpoint, never inside it: vLLM and transformers load every *.safetensors they find there.
        report = load_gguf_linears(model, source, ckpt.with_name(ckpt.name + ".quant"), kernel, n_layers)
        log.info("byblock: %s", report.summary())
        kinds: dict[str, int] = {}
        for kind in report.kept.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        return "gguf (" + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + ")"
    count = quantize_linears(model, 8 if fmt is WeightFormat.INT8 else 4, kernel, replaced=release)
    log.info("byblock: %d linears quantized to %s", count, fmt.value)
    return fmt.value
