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

from byblock.engine.api import generate, stream
from byblock.errors import ByblockError
from byblock.models.loading import load_model
from byblock.sampling.params import SamplingParams

__all__ = ["ByblockError", "SamplingParams", "__version__", "generate", "load_model", "stream"]
