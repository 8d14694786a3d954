"""Other engines as bench methods: `vllm` (plain), `vllm-dflash[:PATH][@K]` and `vllm-eagle3[:PATH][@K]`
(byblock's DFlash drafter / EAGLE-3 head exported with `byblock export --format vllm`, inside vLLM), `llamacpp` and
`llamacpp-dflash[:PATH][@K]` / `llamacpp-eagle3[:PATH][@K]`
(llama-server on the target's GGUF, with the drafter exported as GGUF) and `llamacpp-lookup[@K]` (llama-server's
own prompt lookup), fed byblock's own prompt token ids.

A batch of prompts goes to vLLM as one `generate` call, so at `--batch N` vLLM schedules them as its
continuous batch; τ and the acceptance histogram come from vLLM's per-request spec-decode metrics. llama-server
gets a batch as concurrent requests to as many slots; it reports drafted and accepted counts per request, not
rounds, so its rounds are drafted / K (it drafts K tokens every round with --spec-draft-p-min 0). Prompt lookup
drafts only where an n-gram matches, and fewer than K where the match runs out, so its rows carry no τ.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from byblock.bench.methods import MethodSpec, TurnResult
from byblock.engine.types import SpecStats
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams

LOOKUP_K = 8  # llamacpp-lookup's default draft length: byblock's ngram default (drafters/ngram.py)
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "auto": "auto"}


@dataclass(frozen=True)
class PeerSetup:
    """What every peer shares: where vLLM lives and how it is pinned to this machine's cores."""

    model: str  # byblock's model name or path (resolved to the HF directory vLLM opens)
    dtype: str = "fp32"
    seed: int = 0
    vllm_python: str | None = None
    vllm_kv_cache_gib: int = 2  # per vLLM peer (VLLM_CPU_KVCACHE_SPACE)
    llama_server: str | None = None
    llamacpp_gguf: str | None = None  # the target's GGUF for llama.cpp (default: a built-in's own)
    batch: int = 1  # llama-server slots
    # vLLM's default ("auto") keeps one core for its scheduler; on a 2-core host binding its OpenMP threads to
    # every core is faster (18 vs 14 tok/s at batch 1) and its idle engine does not spin (measured, dev/LOG.md).
    threads_bind: str | None = f"0-{(os.cpu_count() or 1) - 1}"


def stats_from_counts(drafted: int, accepted: int, k: int) -> SpecStats:
    """byblock's τ counters from llama.cpp's per-request draft totals (K drafted per round)."""
    rounds = -(-drafted // k) if drafted else 0
    return SpecStats(rounds=rounds, drafted_nodes=drafted, emitted_by_rounds=accepted + rounds)


def stats_from_histogram(hist: list[int], k: int) -> SpecStats:
    """byblock's counters from vLLM's per-request histogram (hist[j] = verify steps accepting j drafts)."""
    s = SpecStats()
    for j, count in enumerate(hist):
        for _ in range(count):
            s.record(draft_depth=k, num_nodes=k, accepted=j, draft_s=0.0, verify_s=0.0)
    return s


class _PeerRunner:
    """What every engine peer shares: the exported drafter's lifetime, the batch call, the shutdown. A subclass
    sets `peer` (whose `generate` takes the same arguments for every engine), `k` and `engine_label`."""

    peer: Any
    k: int = 0  # drafted tokens per round; 0 = plain decoding
    _tmp: tempfile.TemporaryDirectory | None = None

    def _export(self, spec: MethodSpec, model: str, write: Callable[[Path, Path], Path]) -> str:
        """Export the DFlash drafter with `write(src, tmpdir)`; sets K = block size - 1 (or @K - 1)."""
        from byblock.handoff.export import dflash_source

        assert spec.drafter is not None
        src = dflash_source(spec.drafter.model, model)
        self._tmp = tempfile.TemporaryDirectory(prefix="byblock-peer-export-")
        out = write(src, Path(self._tmp.name))
        self.k = (spec.size or int(json.loads((src / "config.json").read_text()).get("block_size", 16))) - 1
        return str(out)

    def _export_eagle3(self, spec: MethodSpec, model: str, llamacpp_gguf: str | None = None) -> str:
        """Export the EAGLE-3 head for vLLM, or as llama.cpp's GGUF given the target's GGUF; sets K = its chain
        depth (block size - 1, or @K - 1)."""
        from byblock.handoff.export import EngineFormat, export_drafter

        assert spec.drafter is not None
        self._tmp = tempfile.TemporaryDirectory(prefix="byblock-peer-export-")
        text = "eagle3" + (f":{spec.drafter.model}" if spec.drafter.model else "")
        fmt = EngineFormat.LLAMACPP if llamacpp_gguf else EngineFormat.VLLM
        out = Path(self._tmp.name) / ("eagle3-draft.gguf" if llamacpp_gguf else "eagle3")
        done = export_drafter(text, model, fmt, out, llamacpp_gguf)
        self.k = (spec.size or done.block_size) - 1
        return str(done.out)

    def _stats(self, out) -> SpecStats | None:
        raise NotImplementedError

    def run(self, ids: list[int], params: SamplingParams) -> TurnResult:
        """One prompt (a batch of one)."""
        return self.run_batch([ids], params)[0][0]

    def run_batch(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[TurnResult], float]:
        """Prompts as one engine batch; returns the answers and the batch's wall time."""
        outs, wall = self.peer.generate(
            prompts,
            max_tokens=params.max_new_tokens,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )
        if hasattr(self.peer, "pause"):  # stopped while other methods run: an idle engine is not free here
            self.peer.pause()
        # a batch of one is timed by the same clock byblock's rows use; in a batch, each request's own latency
        results = [TurnResult(o.ids, o.ttft_s, wall if len(prompts) == 1 else o.total_s, self._stats(o)) for o in outs]
        return results, wall

    def close(self) -> None:
        """End the engine process and remove the exported drafter."""
        self.peer.close()
        if self._tmp is not None:
            self._tmp.cleanup()


class VllmRunner(_PeerRunner):
    """vLLM's offline engine bound to one method; a batch is one `generate` call."""

    def __init__(self, spec: MethodSpec, target: TargetModel, setup: PeerSetup) -> None:
        from byblock.handoff.vllm import export_vllm
        from byblock.handoff.vllm_peer import PeerConfig, VllmPeer, find_vllm_python
        from byblock.models.loading import resolve_checkpoint

        if setup.dtype not in DTYPES:
            raise ByblockError(f"vLLM peers take --dtype fp32|bf16|auto, not '{setup.dtype}'")
        self.spec = spec
        python = find_vllm_python(setup.vllm_python)
        draft, method = None, "dflash"
        if spec.drafter is not None and spec.drafter.kind.value.startswith("eagle3"):
            draft, method = self._export_eagle3(spec, setup.model), "eagle3"
        elif spec.drafter is not None:
            head = target.hf.get_output_embeddings().weight.detach()
            draft = self._export(spec, setup.model, lambda src, tmp: export_vllm(src, tmp / "dflash", head))
        cfg = PeerConfig(
            target=resolve_checkpoint(setup.model),
            draft=draft,
            method=method,
            k=max(self.k, 1),
            dtype=DTYPES[setup.dtype],
            seed=setup.seed,
            threads_bind=setup.threads_bind,
            kv_cache_gib=setup.vllm_kv_cache_gib,
        )
        self.peer = VllmPeer(cfg, python)
        self.engine_label = f"vLLM {self.peer.version} ({cfg.dtype})"

    def _stats(self, out) -> SpecStats | None:
        return stats_from_histogram(out.accept_hist, self.k) if out.accept_hist is not None else None


class LlamaCppRunner(_PeerRunner):
    """llama-server bound to one method; a batch is concurrent requests to as many slots."""

    def __init__(self, spec: MethodSpec, target: TargetModel, setup: PeerSetup) -> None:
        from byblock.handoff.export import target_gguf_of
        from byblock.handoff.llamacpp import export_llamacpp
        from byblock.handoff.llamacpp_peer import LlamaCppConfig, LlamaCppPeer, find_llama_server

        self.spec = spec
        binary = find_llama_server(setup.llama_server)
        gguf = target_gguf_of(setup.model, setup.llamacpp_gguf)
        draft, spec_type = None, "draft-dflash"
        if spec.drafter is not None and spec.drafter.kind.value.startswith("eagle3"):
            draft, spec_type = self._export_eagle3(spec, setup.model, str(gguf)), "draft-eagle3"
        elif spec.drafter is not None:
            head = target.hf.get_output_embeddings().weight.detach()
            write = lambda src, tmp: export_llamacpp(src, tmp / "dflash-draft.gguf", head, gguf)  # noqa: E731
            draft = self._export(spec, setup.model, write)
        lookup_k = (spec.size or LOOKUP_K) if spec.lookup else 0
        cfg = LlamaCppConfig(
            target_gguf=str(gguf),
            draft_gguf=draft,
            spec_type=spec_type,
            k=max(self.k, 1),
            slots=setup.batch,
            lookup_k=lookup_k,
        )
        self.peer = LlamaCppPeer(cfg, binary, frozenset(target.eos_token_ids))
        self.engine_label = f"{self.peer.version}, {Path(gguf).name}"

    def _stats(self, out) -> SpecStats | None:
        return stats_from_counts(out.drafted, out.accepted, self.k) if self.k else None
