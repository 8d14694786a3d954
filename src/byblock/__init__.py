"""byblock: block-parallel LLM decoding that never changes what the model would have said.

Public API:
    load_model(name_or_path)            -> TargetModel
    generate(model, prompt, params)     -> GenerationResult
    stream(model, prompt, params)       -> iterator of StreamEvent
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("byblock")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+local"

# The public names load on first use (PEP 562): importing a light submodule (byblock.errors, the model registry,
# most CLI argument parsers) does not pull in the engine, transformers and the model loaders with it.
_LAZY = {
    "generate": "byblock.engine.api",
    "stream": "byblock.engine.api",
    "ByblockError": "byblock.errors",
    "load_model": "byblock.models.loading",
    "SamplingParams": "byblock.sampling.params",
    "Grammar": "byblock.sampling.grammar",
}

__all__ = ["ByblockError", "Grammar", "SamplingParams", "__version__", "generate", "load_model", "stream"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'byblock' has no attribute {name!r}")
