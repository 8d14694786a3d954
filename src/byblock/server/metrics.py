"""Prometheus metrics of one server (its own registry: two servers in one process never share counters).

What seed 000 §4.2 asks a deployment to watch: requests, tokens, time to first token and per output token
(histograms: p50/p99 via histogram_quantile), τ and acceptance per drafter, queue depth, process memory.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from byblock.engine.types import GenerationResult
from byblock.server.vllm_metrics import VllmMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


def _usage(core) -> Callable[[], float]:
    def usage() -> float:
        held, budget = core.kv_usage()
        return held / budget if budget else 0.0

    return usage


class ServerMetrics:
    """Every metric the server exports, registered on a private registry."""

    def __init__(
        self,
        queue_depth: Callable[[], float],
        running: Callable[[], float],
        model_name: str = "model",
        max_context: int = 8192,
    ) -> None:
        """model_name / max_context: the served model's (vLLM-named series are labelled with the name)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, model_name, max_context, queue_depth, running)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        self.requests = Counter("byblock_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r)
        self.aborted = Counter("byblock_requests_aborted", "Requests stopped by a client disconnect", registry=r)
        self.prompt_tokens = Counter("byblock_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("byblock_generation_tokens", "Tokens generated", ["drafter"], registry=r)
        self.ttft = Histogram(
            "byblock_time_to_first_token_seconds",
            "From request arrival to the first token (queueing included)",
            ["drafter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "byblock_time_per_output_token_seconds",
            "Mean time per output token after the first, one sample per request",
            ["drafter"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "byblock_request_latency_seconds",
            "Request arrival to last token",
            ["drafter"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rounds = Counter("byblock_spec_rounds", "Verification rounds (target forwards)", ["drafter"], registry=r)
        self.emitted = Counter(
            "byblock_spec_emitted_tokens",
            "Tokens emitted by verification rounds (τ = emitted / rounds)",
            ["drafter"],
            registry=r,
        )
        self.drafted = Counter("byblock_spec_draft_tokens", "Draft tokens proposed (nodes)", ["drafter"], registry=r)
        self.accepted = Counter("byblock_spec_accepted_tokens", "Draft tokens accepted", ["drafter"], registry=r)
        self.tau = Gauge("byblock_tau", "Mean tokens per verification round since start", ["drafter"], registry=r)
        self.acceptance = Gauge(
            "byblock_acceptance_rate", "Accepted / proposed draft tokens since start", ["drafter"], registry=r
        )
        g = Gauge("byblock_queue_depth", "Requests waiting for the engine", registry=r)
        g.set_function(queue_depth)
        g = Gauge("byblock_running_requests", "Requests being decoded", registry=r)
        g.set_function(running)
        self._totals: dict[str, list[int]] = {}  # drafter -> [rounds, emitted, drafted, accepted]

    def watch_batches(self, core) -> None:
        """Batch, KV-cache and preemption gauges read from a BatchedEngineCore at scrape time."""
        r = self.registry
        gauges = (
            ("byblock_batch_size", "Requests in the engine's last forward", lambda: core.last_step.seqs),
            ("byblock_batch_rows", "Token rows in the engine's last forward", lambda: core.last_step.rows),
            ("byblock_kv_cache_tokens", "KV-cache slots held by running requests", lambda: core.kv_usage()[0]),
            ("byblock_kv_cache_usage", "KV slots held / --max-kv-tokens (0: no budget)", _usage(core)),
            ("byblock_preemptions", "Requests preempted (recomputed) since start", lambda: core.preemptions),
        )
        for name, doc, fn in gauges:
            Gauge(name, doc, registry=r).set_function(fn)
        self.vllm.watch(_usage(core), lambda: core.preemptions)

    def observe_result(self, result: GenerationResult, ttft_s: float, e2e_s: float) -> None:
        """Record a finished generation; ttft_s / e2e_s are wall times from the request's arrival."""
        self.vllm.observe(result, ttft_s, e2e_s)
        d, s = result.drafter, result.stats
        n = result.num_new_tokens
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.labels(d).inc(n)
        if n:
            self.ttft.labels(d).observe(ttft_s)
        if n > 1:
            self.tpot.labels(d).observe((result.total_s - result.ttft_s) / (n - 1))
        self.e2e.labels(d).observe(e2e_s)
        accepted = s.emitted_by_rounds - s.rounds
        for metric, value in ((self.rounds, s.rounds), (self.emitted, s.emitted_by_rounds)):
            metric.labels(d).inc(value)
        self.drafted.labels(d).inc(s.drafted_nodes)
        self.accepted.labels(d).inc(accepted)
        tot = self._totals.setdefault(d, [0, 0, 0, 0])
        for i, v in enumerate((s.rounds, s.emitted_by_rounds, s.drafted_nodes, accepted)):
            tot[i] += v
        if tot[0]:
            self.tau.labels(d).set(tot[1] / tot[0])
        if tot[2]:
            self.acceptance.labels(d).set(tot[3] / tot[2])

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
