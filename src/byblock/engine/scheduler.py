"""Which requests share the next forward: continuous batching under a sequence cap, a row budget and a KV
budget (nano-vllm's scheduler, with vLLM v1's mixing of prompts and decode rounds in one step).

Every step, every running request decodes (one round each). Waiting requests are then admitted first come
first served while the batch has a free sequence slot, their prompt fits the step's remaining row budget (the
first one is always admitted into an otherwise empty step, however long) and the KV budget holds their
prompt. When the running requests' caches would outgrow the KV budget, the newest is preempted: its cache is
dropped and it waits at the head of the queue to be recomputed (see engine/sequence.py: a recomputed request
keeps its tokens and its generator, so it stays lossless; its K/V come from one prefill instead of its rounds,
so its later logits may differ in the last bits from an unpreempted run).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from byblock.engine.sequence import Phase, Sequence
from byblock.errors import InvalidParameterError


@dataclass(frozen=True)
class BatchConfig:
    """Limits of the batched engine."""

    max_num_seqs: int = 16  # requests decoded together
    max_batched_tokens: int = 2048  # rows per forward: prompts are admitted while they fit beside the rounds
    max_kv_tokens: int | None = None  # cache slots of all running requests together (None: unbounded)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidParameterError("--max-num-seqs must be >= 1")
        if self.max_batched_tokens < 1:
            raise InvalidParameterError("--max-batched-tokens must be >= 1")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 1:
            raise InvalidParameterError("--max-kv-tokens must be >= 1")


class Scheduler:
    """The waiting queue and the running batch."""

    def __init__(self, config: BatchConfig) -> None:
        self.config = config
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

    def admit(self, rows_used: int, slack: dict[str, int]) -> list[Sequence]:
        """Move waiting requests into the batch for this step (see the module docstring); returns them."""
        cfg = self.config
        admitted: list[Sequence] = []
        kv = self.kv_tokens() + sum(slack[s.request_id] for s in self.running)
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            rows = seq.kv_tokens
            alone = rows_used == 0 and not admitted
            if not alone and rows_used + rows > cfg.max_batched_tokens:
                break
            if cfg.max_kv_tokens is not None and self.running and kv + rows > cfg.max_kv_tokens:
                break
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
            rows_used += rows
            kv += rows + slack[seq.request_id]
        return admitted
