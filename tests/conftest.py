"""Shared fixtures: tiny random models, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import ARCHS, make_target, save_checkpoint

torch.set_num_threads(1)

# Files whose tests take minutes in one worker (`--dist loadfile` keeps a file in one process): collected first, so
# they run beside the rest of the suite instead of alone at its end (the vLLM tier: ~4-5 minutes, dev/LOG.md
# session 38). The sort is stable: every other file, and the order inside each file, stay as collected.
LONG_FILES = ("test_vllm_handoff.py",)


def pytest_collection_modifyitems(config, items) -> None:
    """Move the long files' tests to the front of the collection (see LONG_FILES)."""
    items.sort(key=lambda item: item.path.name not in LONG_FILES)


@pytest.fixture(scope="session", params=ARCHS)
def tiny_target(request):
    """A TargetModel of each tiny architecture."""
    return make_target(request.param)


@pytest.fixture(scope="session")
def tiny_targets():
    """{arch: TargetModel} for every tiny architecture."""
    return {arch: make_target(arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny llama checkpoint directory on disk (for the CLI)."""
    return save_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))


def real_model_or_skip(name: str = "smollm2-135m", dtype: str = "float32", activations: str = "int8"):
    """Load a built-in real model (activations: how its quantized linears take inputs), or skip when its package is
    not installed."""
    from byblock.models.registry import BUILTIN_MODELS

    if not BUILTIN_MODELS[name].installed():
        pytest.skip(f"{name} not installed")
    from byblock.models.loading import load_model

    return load_model(name, dtype=dtype, activations=activations)


REGEN_PROMPTS = ["def add(a, b):", "hello world", "the cat sat on", "print(x)", "a b c", "return a", "x = 1", "1 2 3 4"]


@pytest.fixture(scope="session")
def regen_dir(tmp_path_factory, tiny_llama_dir):
    """ROOT with ROOT/regen: the tiny llama's regenerated answers to REGEN_PROMPTS (features of layers 0, 1)."""
    import json

    from byblock.training.regenerate import RegenConfig, regenerate

    root = tmp_path_factory.mktemp("regen")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in REGEN_PROMPTS))
    cfg = RegenConfig(
        target=str(tiny_llama_dir), prompts=str(prompts), layer_ids=(0, 1), max_new_tokens=24, batch_size=3, rows=2
    )
    regenerate(cfg, root / "regen", progress=False)
    return root
