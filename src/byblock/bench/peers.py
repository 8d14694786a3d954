"""Other engines as bench methods: `vllm` (plain) and `vllm-dflash[:PATH][@K]` (byblock's DFlash drafter
exported with `byblock export --format vllm`, inside vLLM), `llamacpp` and `llamacpp-dflash[:PATH][@K]`
(llama-server on the target's GGUF, with the drafter exported as GGUF), fed byblock's own prompt token ids.

A batch of prompts goes to vLLM as one `generate` call, so at `--batch N` vLLM schedules them as its
continuous batch; τ and the acceptance histogram come from vLLM's per-request spec-decode metrics. llama-server
gets a batch as concurrent requests to as many slots; it reports drafted and accepted counts per request, not
rounds, so its rounds are drafted / K (it drafts K tokens every round with --spec-draft-p-min 0).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from byblock.bench.methods import MethodSpec, TurnResult
from byblock.engine.types import SpecStats
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16", "auto": "auto"}


@dataclass(frozen=True)
class PeerSetup:
    """What every peer shares: where vLLM lives and how it is pinned to this machine's cores."""

    model: str  # byblock's model name or path (resolved to the HF directory vLLM opens)
    dtype: str = "fp32"
    seed: int = 0
    vllm_python: str | None = None
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


class VllmRunner:
    """A vLLM engine process bound to one method; `run_batch` sends prompts as one engine call."""

    def __init__(self, spec: MethodSpec, target: TargetModel, setup: PeerSetup) -> None:
        from byblock.handoff.vllm_peer import PeerConfig, VllmPeer, find_vllm_python
        from byblock.models.loading import resolve_checkpoint

        if setup.dtype not in DTYPES:
            raise ByblockError(f"vLLM peers take --dtype fp32|bf16|auto, not '{setup.dtype}'")
        self.spec = spec
        python = find_vllm_python(setup.vllm_python)
        draft, self.k = None, 0
        self._tmp: tempfile.TemporaryDirectory | None = None
        if spec.drafter is not None:
            draft, self.k = self._export(spec, target, setup.model)
        cfg = PeerConfig(
            target=resolve_checkpoint(setup.model),
            draft=draft,
            k=max(self.k, 1),
            dtype=DTYPES[setup.dtype],
            seed=setup.seed,
            threads_bind=setup.threads_bind,
        )
        self.peer = VllmPeer(cfg, python)
        self.engine_label = f"vLLM {self.peer.version}"

    def _export(self, spec: MethodSpec, target: TargetModel, model: str) -> tuple[str, int]:
        """Export the DFlash drafter for vLLM into a temporary directory; K = block size - 1 (or @K - 1)."""
        from byblock.handoff.export import dflash_source
        from byblock.handoff.vllm import export_vllm

        assert spec.drafter is not None
        src = dflash_source(spec.drafter.model, model)
        self._tmp = tempfile.TemporaryDirectory(prefix="byblock-vllm-export-")
        out = export_vllm(src, Path(self._tmp.name) / "dflash", target.hf.get_output_embeddings().weight.detach())
        block = spec.size or int(json.loads((out / "config.json").read_text()).get("block_size", 16))
        return str(out), block - 1

    def run(self, ids: list[int], params: SamplingParams) -> TurnResult:
        """One prompt (a batch of one)."""
        return self.run_batch([ids], params)[0][0]

    def run_batch(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[TurnResult], float]:
        """Prompts as one vLLM batch; returns the answers and the call's wall time."""
        greedy = params.greedy
        outs, wall = self.peer.generate(
            prompts,
            max_tokens=params.max_new_tokens,
            temperature=0.0 if greedy else params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )
        results = []
        for o in outs:
            stats = stats_from_histogram(o.accept_hist, self.k) if o.accept_hist is not None else None
            total = wall if len(prompts) == 1 else o.total_s  # batch of one: the same clock byblock's rows use
            results.append(TurnResult(o.ids, o.ttft_s, total, stats))
        return results, wall

    def close(self) -> None:
        """End the engine process and remove the exported drafter."""
        self.peer.close()
        if self._tmp is not None:
            self._tmp.cleanup()


class LlamaCppRunner:
    """llama-server bound to one method; `run_batch` sends a batch as concurrent requests."""

    def __init__(self, spec: MethodSpec, target: TargetModel, setup: PeerSetup) -> None:
        from byblock.handoff.export import target_gguf_of
        from byblock.handoff.llamacpp_peer import LlamaCppConfig, LlamaCppPeer, find_llama_server

        self.spec = spec
        binary = find_llama_server(setup.llama_server)
        gguf = target_gguf_of(setup.model, setup.llamacpp_gguf)
        draft, self.k = None, 0
        self._tmp: tempfile.TemporaryDirectory | None = None
        if spec.drafter is not None:
            from byblock.handoff.export import dflash_source
            from byblock.handoff.llamacpp import export_llamacpp

            src = dflash_source(spec.drafter.model, setup.model)
            self._tmp = tempfile.TemporaryDirectory(prefix="byblock-llamacpp-export-")
            head = target.hf.get_output_embeddings().weight.detach()
            draft = str(export_llamacpp(src, Path(self._tmp.name) / "dflash-draft.gguf", head, gguf))
            block = spec.size or int(json.loads((src / "config.json").read_text()).get("block_size", 16))
            self.k = block - 1
        cfg = LlamaCppConfig(target_gguf=str(gguf), draft_gguf=draft, k=max(self.k, 1), slots=setup.batch)
        self.peer = LlamaCppPeer(cfg, binary, frozenset(target.eos_token_ids))
        self.engine_label = f"{self.peer.version}, {Path(gguf).name}"

    def run(self, ids: list[int], params: SamplingParams) -> TurnResult:
        """One prompt (a batch of one)."""
        return self.run_batch([ids], params)[0][0]

    def run_batch(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[TurnResult], float]:
        """Prompts as concurrent requests; returns the answers and the batch's wall time."""
        outs, wall = self.peer.generate(
            prompts,
            max_tokens=params.max_new_tokens,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )
        results = []
        for o in outs:
            stats = stats_from_counts(o.drafted, o.accepted, self.k) if self.k else None
            results.append(TurnResult(o.ids, o.ttft_s, wall if len(prompts) == 1 else o.total_s, stats))
        return results, wall

    def close(self) -> None:
        """Stop the server and remove the exported drafter."""
        self.peer.close()
        if self._tmp is not None:
            self._tmp.cleanup()
