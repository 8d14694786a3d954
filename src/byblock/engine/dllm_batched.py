"""Continuous batching for mask diffusion LMs: every running request's next forward in one packed forward.

A request is a small state machine over its own block KV cache, one forward per step:

    prefill   the prompt, causal                                   -> then denoise
    denoise   the canvas, bidirectional, against the cache          -> one MaskBlock step (dllm/mask_step.py);
              (its K/V are cropped again)                              a decided block is emitted, then commit
    commit    the decided block, bidirectional, written to the cache -> denoise the next block

Requests join and leave at any step (unlike dllm/batch.py's lockstep batch, which admits a batch at once and
holds decided rows until the slowest row's block is done). The packed forward is the autoregressive engine's
(models/adapter.py forward_packed: linears over all rows, attention per request with exactly its own mask), so
with row-invariant linears each request computes the forwards `diffusion_generate` computes alone, in the same
order, with its own generator: its tokens equal its solo run (tests/test_dllm_batched.py).
`prepare_for_batching` gives a model those kernels on the CPU in fp32 (byblock's packed GEMM, and the SDPA
function that splits packed rows per request); elsewhere a batched request is identical in law only.
"""

from __future__ import annotations

import time
from collections import deque
from enum import Enum

import torch

from byblock.dllm.config import CacheMode, DllmConfig, SamplerKind
from byblock.dllm.denoisers import MaskDenoiser
from byblock.dllm.mask_step import MaskBlock
from byblock.engine.batched import StepStats
from byblock.engine.core import EngineRequest, RequestOutput
from byblock.engine.dllm_core import BlockStream, request_config
from byblock.engine.scheduler import BatchConfig
from byblock.errors import ByblockError, InvalidParameterError
from byblock.kv.kv_cache import KVCache
from byblock.models.adapter import SegmentInput, TargetModel
from byblock.sampling.processors import make_generator


def batchable(denoiser: object, cfg: DllmConfig) -> bool:
    """Whether this model and sampler can run in the batched diffusion engine: a block-causal mask model with
    the exact block cache (uniform-state models, full bidirectional attention and the prefix cache decode FIFO)."""
    return (
        isinstance(denoiser, MaskDenoiser)
        and not denoiser.full_bidirectional
        and cfg.cache is CacheMode.EXACT
        and cfg.sampler is not SamplerKind.RENOISE
    )


def prepare_for_batching(denoiser: MaskDenoiser) -> None:
    """Give a CPU fp32 model row-invariant linears (byblock's packed GEMM, where it builds) and byblock's SDPA
    function, which packed forwards need; solo decoding then runs the same kernels (so it stays the reference)."""
    from byblock.kernels.gqa_sdpa import enable_gqa_sdpa

    hf = denoiser.hf
    if hf.config._attn_implementation == "sdpa":
        enable_gqa_sdpa(hf)
    if denoiser.device.type == "cpu" and denoiser.dtype == torch.float32:
        from byblock.kernels.packed_gemm import load_kernel, pack_linears

        if (kernel := load_kernel()) is not None:
            pack_linears(hf, kernel)


class Phase(Enum):
    """Which forward a request needs next."""

    PREFILL = "prefill"
    DENOISE = "denoise"
    COMMIT = "commit"


class DllmSequence:
    """One diffusion request in the batch."""

    def __init__(self, req: EngineRequest, cfg: DllmConfig, out: BlockStream, device: torch.device) -> None:
        self.req = req
        self.cfg = cfg
        self.out = out
        self.cache = KVCache(device=device)
        self.generator = make_generator(cfg.seed, device)
        self.phase = Phase.PREFILL
        self.block: MaskBlock | None = None
        self.decided: list[int] = []  # the last decided block, committed by the next forward

    def segment(self, mask_id: int, size: int, ones: torch.Tensor) -> tuple[SegmentInput, int]:
        """This step's segment and how many logits rows it needs."""
        if self.phase is Phase.PREFILL:
            return SegmentInput(self.cache, list(self.req.prompt_ids), prompt=True), 0
        if self.phase is Phase.COMMIT:
            return SegmentInput(self.cache, self.decided, tree_mask=ones), 0
        if self.block is None:
            self.block = MaskBlock(self.cfg, size, mask_id, self.generator, ones.device)
        return SegmentInput(self.cache, self.block.canvas[0].tolist(), tree_mask=ones), size


class DllmBatchedEngineCore:
    """EngineCore over continuous batching for a block-causal mask diffusion model (see the module docstring)."""

    drafter_names: tuple[str, ...] = ("none",)

    def __init__(
        self,
        denoiser: MaskDenoiser,
        tokenizer,
        eos_token_ids: frozenset[int],
        base: DllmConfig,
        config: BatchConfig | None = None,
    ) -> None:
        """The model should have been through prepare_for_batching (the batched forward needs its SDPA)."""
        if not batchable(denoiser, base):
            raise InvalidParameterError("the batched diffusion engine needs a block-causal mask model, exact cache")
        self.denoiser = denoiser
        self.model = TargetModel(denoiser.hf, tokenizer, name="dllm", own_forward=False)  # the packed forward
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self.base = base
        self.config = config or BatchConfig()
        self.label = f"dllm-{base.sampler.value}"
        self.block_size = base.block_size or denoiser.default_block_size
        self._ones = torch.ones(self.block_size, self.block_size, dtype=torch.bool, device=denoiser.device)
        self.waiting: deque[DllmSequence] = deque()
        self.running: list[DllmSequence] = []
        self._failed: list[RequestOutput] = []
        self.last_step = StepStats()  # the server's batch gauges
        self.preemptions = 0  # prompts are admitted whole and blocks are small: nothing is preempted

    # -- the EngineCore contract -------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; a bad one is answered by the next step with an error output."""
        try:
            cfg = request_config(self.base, request)
        except ByblockError as e:
            self._failed.append(RequestOutput(request.request_id, error=str(e)))
            return
        out = BlockStream(request, self.tokenizer, self.eos, self.label, self.block_size)
        self.waiting.append(DllmSequence(request, cfg, out, self.denoiser.device))

    def abort_request(self, request_id: str) -> None:
        """Drop a request, queued or running; its cache is freed at once."""
        self.waiting = deque(s for s in self.waiting if s.req.request_id != request_id)
        self.running = [s for s in self.running if s.req.request_id != request_id]
        self._failed = [f for f in self._failed if f.request_id != request_id]

    def has_unfinished(self) -> bool:
        """True while a request is queued or running (or a refusal is still to be reported)."""
        return bool(self.waiting) or bool(self.running) or bool(self._failed)

    def num_waiting(self) -> int:
        """Requests queued."""
        return len(self.waiting)

    def num_running(self) -> int:
        """Requests in the batch."""
        return len(self.running)

    def kv_usage(self) -> tuple[int, int | None]:
        """(cache slots held, None: the diffusion engine has no KV budget)."""
        return sum(s.cache.length for s in self.running), None

    # -- one step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, run every running request's next forward in one packed forward, advance each."""
        outputs, self._failed = self._failed, []
        self._admit()
        if not self.running:
            return outputs
        mask_id = self.denoiser.mask_token_id
        assert mask_id is not None
        segments, logits_rows, firsts, total = [], [], [], 0
        for seq in self.running:
            seg, rows = seq.segment(mask_id, self.block_size, self._ones)
            segments.append(seg)
            firsts.append(len(logits_rows))  # its first row in the forward's logits
            logits_rows.extend(range(total, total + rows))
            total += len(seg.input_ids)
        pasts = [seq.cache.length for seq in self.running]
        t0 = time.perf_counter()
        try:
            out = self.model.forward_packed(segments, logits_rows)
        except Exception as e:  # a bug in the forward fails this step's requests, never the engine thread
            failed, self.running = self.running, []
            return outputs + [self._error(seq, e) for seq in failed]
        prefills = sum(s.phase is Phase.PREFILL for s in self.running)
        self.last_step = StepStats(len(segments), total, prefills, time.perf_counter() - t0)
        still = []
        for seq, past, first in zip(self.running, pasts, firsts, strict=True):
            try:
                outs = self._advance(seq, past, out.logits[first : first + self.block_size])
            except Exception as e:
                outputs.append(self._error(seq, e))
                continue
            outputs.extend(outs)
            if not seq.out.done:
                still.append(seq)
        self.running = still
        return outputs

    def _admit(self) -> None:
        """Waiting requests join while a slot is free and their prompt fits the row budget (the first always)."""
        rows = sum(len(s.req.prompt_ids) if s.phase is Phase.PREFILL else self.block_size for s in self.running)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            need = len(self.waiting[0].req.prompt_ids)
            if rows and rows + need > self.config.max_batched_tokens:
                break
            self.running.append(self.waiting.popleft())
            rows += need

    def _advance(self, seq: DllmSequence, past: int, logits: torch.Tensor) -> list[RequestOutput]:
        """Apply the forward to one request (logits: its canvas rows, if it denoised); returns its outputs."""
        rid = seq.req.request_id
        if seq.phase is not Phase.DENOISE:  # a prefill or a commit: its K/V stay
            seq.phase = Phase.DENOISE
            return []
        seq.cache.crop(past)  # a denoise only reads the cache
        block = seq.block
        assert block is not None
        block.step(logits.float()[None])
        if not block.done:
            return []
        decided = block.canvas[0].tolist()
        outs = []
        if (event := seq.out.push(decided, block.steps)) is not None:
            outs.append(RequestOutput(rid, event=event))
        seq.block, seq.decided, seq.phase = None, decided, Phase.COMMIT
        if seq.out.done:
            if (tail := seq.out.close()) is not None:
                outs.append(RequestOutput(rid, event=tail))
            outs.append(RequestOutput(rid, result=seq.out.result()))
        return outs

    def _error(self, seq: DllmSequence, e: Exception) -> RequestOutput:
        rid = seq.req.request_id
        if isinstance(e, ByblockError):
            return RequestOutput(rid, error=str(e))
        return RequestOutput(rid, error=f"internal error: {type(e).__name__}: {e}", internal=True)
