"""vLLM's `--speculative-config` JSON, accepted by generate / serve / bench and mapped onto byblock's drafters.

Counting: vLLM's `num_speculative_tokens`, llama.cpp's `--draft-max`, mlx-lm's `--num-draft-tokens` and HF's
`num_assistant_tokens` count *drafted* tokens per round; byblock's `--block-size` counts the verify forward's
tokens, the anchor included. So num_speculative_tokens = k maps to --block-size k + 1, and a DFlash drafter
trained at block 16 drafts 15 tokens per round in either notation.

    {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    {"method": "draft_model", "model": "ID", "num_speculative_tokens": 4}
    {"method": "dflash", "model": "PATH"}          (PATH optional: the shipped drafter)
    byblock's own methods: ddtree | hybrid | domino | dominotree, and "adaptive": true for dflash/ddtree/hybrid;
    trees take "tree_budget" (draft nodes per round) instead of num_speculative_tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from byblock.errors import ByblockError

METHODS = {
    "ngram": "ngram",
    "draft_model": "model",
    "dflash": "dflash",
    "ddtree": "ddtree",
    "hybrid": "hybrid",
    "domino": "domino",
    "dominotree": "dominotree",
}
TREES = ("ddtree", "hybrid", "dominotree")
UNSUPPORTED = ("eagle", "eagle3", "mtp", "medusa", "mlp_speculator", "suffix", "custom_class")
# vLLM deployment keys with no meaning in one byblock process: accepted so a vLLM config file works unchanged.
IGNORED = (
    "draft_tensor_parallel_size",
    "disable_padded_drafter_batch",
    "max_model_len",
    "quantization",
    "revision",
    "code_revision",
    "disable_by_batch_size",
    "speculative_token_tree",
    "parallel_drafting",
)
KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "tree_budget",
    "num_candidates",
    "adaptive",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed --speculative-config."""

    method: str
    model: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    tree_budget: int | None = None
    num_candidates: int | None = None
    adaptive: bool = False

    @staticmethod
    def parse(text: str) -> SpeculativeConfig:
        """JSON text -> SpeculativeConfig; a one-line ByblockError for anything byblock cannot honour."""
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ByblockError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ByblockError("--speculative-config must be a JSON object")
        unknown = sorted(set(obj) - set(KEYS) - set(IGNORED))
        if unknown:
            raise ByblockError(f"--speculative-config: unknown key(s) {', '.join(unknown)} (known: {', '.join(KEYS)})")
        method = obj.get("method")
        if method in UNSUPPORTED:
            raise ByblockError(f"--speculative-config: method '{method}' is not available in byblock")
        if method not in METHODS:
            raise ByblockError(f"--speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}")
        for key in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "tree_budget",
            "num_candidates",
        ):
            v = obj.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ByblockError(f"--speculative-config: {key} must be an integer >= 1, got {v!r}")
        if method == "draft_model" and not obj.get("model"):
            raise ByblockError("--speculative-config: method draft_model needs a model")
        if method == "ngram" and obj.get("model"):
            raise ByblockError("--speculative-config: method ngram takes no model")
        if obj.get("adaptive") and method not in ("dflash", "ddtree", "hybrid"):
            raise ByblockError("--speculative-config: adaptive works with dflash, ddtree or hybrid")
        if method in TREES and obj.get("num_speculative_tokens") is not None:
            raise ByblockError(
                f"--speculative-config: {method} drafts trees; give tree_budget, not num_speculative_tokens"
            )
        return SpeculativeConfig(**{k: obj[k] for k in KEYS if k in obj})

    @property
    def drafter(self) -> str:
        """The --drafter text."""
        name = ("adaptive-" if self.adaptive else "") + METHODS[self.method]
        return f"{name}:{self.model}" if self.model else name

    @property
    def block_size(self) -> int | None:
        """byblock's block size (anchor included), or None for the drafter's default."""
        return None if self.num_speculative_tokens is None else self.num_speculative_tokens + 1

    def knobs(self) -> dict[str, int]:
        """DrafterSpec knobs this config sets (the rest keep the command's values)."""
        out = {
            "block_size": self.block_size,
            "tree_budget": self.tree_budget,
            "num_candidates": self.num_candidates,
            "ngram_max": self.prompt_lookup_max,
            "ngram_min": self.prompt_lookup_min,
        }
        return {k: v for k, v in out.items() if v is not None}

    def bench_method(self) -> str:
        """The `byblock bench` method name (@K: block size for chains, node budget for trees)."""
        name = self.drafter
        if self.adaptive:  # bench spells adaptive dflash / ddtree as adaptive / adaptive-tree
            name = name.replace("adaptive-dflash", "adaptive").replace("adaptive-ddtree", "adaptive-tree")
        size = self.tree_budget if self.method in TREES or self.adaptive else self.block_size
        return f"{name}@{size}" if size else name
