"""Which requests share the next forward: continuous batching under a sequence cap, a row budget and a KV
budget (nano-vllm's scheduler, with vLLM v1's mixing of prompts and decode rounds in one step).

Every step, every running request decodes (one round each). Requests still prefilling then take their next
chunk, and waiting requests are admitted first come first served while the batch has a free sequence slot,
the step's remaining row budget holds their prompt or (chunked prefill) at least one chunk,
and the KV budget holds their whole prompt. Without chunking a prompt must fit whole (the first one is always
admitted into an otherwise empty step, however long), so one long prompt stalls every decoding request for
its whole prefill. Chunks are multiples of the attention's query tile (kernels/gqa_sdpa.py PREFILL_TILE), so
a chunked prompt's K/V are bitwise those of one prefill forward on the fp32 packed kernels; chunking is on by
default there and off with the bf16 row-invariant kernels (measured: benchmarks/RESULTS.md §5c).

When the running requests' caches would outgrow the KV budget, the newest is preempted: its cache is dropped
and it waits at the head of the queue to be recomputed (see engine/sequence.py: a recomputed request keeps its
tokens and its generator, so it stays lossless; its K/V come from one prefill instead of its rounds, so its
later logits may differ in the last bits from an unpreempted run).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from byblock.engine.sequence import Phase, Sequence
from byblock.errors import InvalidParameterError
from byblock.kernels.gqa_sdpa import PREFILL_TILE


@dataclass(frozen=True)
class BatchConfig:
    """Limits of the batched engine."""

    max_num_seqs: int = 16  # requests decoded together
    max_batched_tokens: int = 2048  # rows per forward: prompts are admitted while they fit beside the rounds
    max_kv_tokens: int | None = None  # cache slots of all running requests together (None: unbounded)
    # Split prompts longer than the step's free rows into chunks. None: where chunks are bitwise one prefill
    # (byblock's fp32 attention; not the bf16 row-invariant one, whose prompt path is another kernel).
    chunked_prefill: bool | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidParameterError("--max-num-seqs must be >= 1")
        if self.max_batched_tokens < 1:
            raise InvalidParameterError("--max-batched-tokens must be >= 1")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise InvalidParameterError("--max-kv-tokens must be >= 1")
        if self.chunked_prefill is True and self.max_batched_tokens < PREFILL_TILE:
            raise InvalidParameterError(
                f"--max-batched-tokens must be >= {PREFILL_TILE} with chunked prefill "
                "(or pass --no-enable-chunked-prefill)"
            )


class Scheduler:
    """The waiting queue and the running batch."""

    def __init__(self, config: BatchConfig, chunk_exact: bool = True) -> None:
        """chunk_exact: whether the model's chunked prefill is bitwise one prefill (decides chunked_prefill=None)."""
        self.config = config
        auto = chunk_exact and config.max_batched_tokens >= PREFILL_TILE
        self.chunked = auto if config.chunked_prefill is None else config.chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a request."""
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out, freeing its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.cache = None
        seq.phase = Phase.FINISHED

    def kv_tokens(self) -> int:
        """Cache slots the running requests hold."""
        return sum(seq.kv_tokens for seq in self.running)

    def preempt_for_kv(self, slack: dict[str, int]) -> None:
        """Preempt the newest running requests until every running one can add its next round's rows
        (`slack`: request id -> rows its round may add) within the KV budget."""
        budget = self.config.max_kv_tokens
        if budget is None:
            return
        while len(self.running) > 1 and sum(s.kv_tokens + slack[s.request_id] for s in self.running) > budget:
            victim = self.running.pop()
            victim.preempt()
            self.waiting.appendleft(victim)
            self.preemptions += 1

    def chunk(self, left: int, rows_used: int, must_run: bool) -> int:
        """Prefill rows a request with `left` rows still to prefill runs this step beside `rows_used` others
        (0: it waits). must_run: it runs however full the step is (the step's first prompt, or a chunked
        prompt already in the batch, which never stalls)."""
        free = self.config.max_batched_tokens - rows_used
        if left <= free:
            return left
        if not self.chunked:
            return left if must_run else 0
        rows = free // PREFILL_TILE * PREFILL_TILE
        return min(left, max(rows, PREFILL_TILE)) if must_run else rows

    def prefills(self, rows_used: int) -> list[tuple[Sequence, int]]:
        """The next chunk of every running request still prefilling, oldest first, as (request, rows)."""
        chunks = []
        for seq in self.running:
            if seq.phase is Phase.PREFILLING:
                rows = self.chunk(seq.prefill_left, rows_used, must_run=True)
                chunks.append((seq, rows))
                rows_used += rows
        return chunks

    def admit(self, rows_used: int, slack: dict[str, int]) -> list[tuple[Sequence, int]]:
        """Move waiting requests into the batch for this step (see the module docstring); returns them with
        the prefill rows each runs now."""
        cfg = self.config
        admitted: list[tuple[Sequence, int]] = []
        kv = self.kv_tokens() + sum(slack[s.request_id] for s in self.running)
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            slots = seq.kv_tokens
            rows = self.chunk(seq.prefill_left, rows_used, must_run=rows_used == 0 and not admitted)
            if rows == 0:
                break
            if cfg.max_kv_tokens is not None and self.running and kv + slots > cfg.max_kv_tokens:
                break
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append((seq, rows))
            rows_used += rows
            kv += slots + slack[seq.request_id]
        return admitted
