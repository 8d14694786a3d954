"""Diffusion LMs: a canvas of tokens filled in a few parallel denoising steps, block by block.

One loop (generate.py) drives every sampler; a sampler is a small file with a fast tensor rule and a
paper-faithful reference beside it. Models come in two families (denoisers.py): mask-absorbing
(LLaDA / Fast-dLLM / byblock's puzzle models) and uniform-state with renoising (DiffusionGemma).
"""

from byblock.dllm.config import CacheMode, DllmConfig, SamplerKind

__all__ = ["CacheMode", "DllmConfig", "SamplerKind"]
