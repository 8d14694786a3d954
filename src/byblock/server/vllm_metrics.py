"""The server's metrics under vLLM's names (vllm/v1/metrics/loggers.py, v1/spec_decode/metrics.py of vLLM
0.32), labelled `model_name` and `engine` as vLLM labels them, so dashboards built for vLLM read a byblock
server unchanged. byblock's own series (τ, acceptance, batch rows) stay beside them (server/metrics.py).

Where byblock measures less finely than vLLM it says so: `vllm:inter_token_latency_seconds` gets, per request,
its mean inter-token time once per interval (a speculative round emits tokens in bursts, so per-token gaps
would be 0 inside a block and large between blocks; the mean is what a client sees on average).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from byblock.engine.types import GenerationResult

LATENCY = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def _one_two_five(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50 … up to `limit` (vLLM's token-count buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if base * m > limit:
                return tuple(float(x) for x in out)
            out.append(base * m)
        base *= 10


class _FnCounter(Collector):
    """A counter whose value is read from the engine at scrape time (e.g. preemptions)."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], fn: Callable[[], float]) -> None:
        self.name, self.doc, self.labels, self.fn = name, doc, labels, fn

    def collect(self):
        fam = CounterMetricFamily(self.name, self.doc, labels=list(self.labels))
        fam.add_metric(list(self.labels.values()), self.fn())
        yield fam


class VllmMetrics:
    """vLLM-named series on `registry` for one served model."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_context: int,
        waiting: Callable[[], float],
        running: Callable[[], float],
    ) -> None:
        r, names = registry, ["model_name", "engine"]
        self.lv = (model_name, "0")
        self.kv_usage: Callable[[], float] = lambda: 0.0
        self.preemptions: Callable[[], float] = lambda: 0
        for name, doc, fn in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: self.kv_usage()),
        ):
            Gauge(name, doc, names, registry=r).labels(*self.lv).set_function(fn)
        labels = dict(zip(names, self.lv, strict=True))
        r.register(
            _FnCounter("vllm:num_preemptions", "Cumulative number of preemptions.", labels, lambda: self.preemptions())
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", names, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", names, registry=r
        )
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"], registry=r
        )
        tokens = _one_two_five(max_context)
        hist = {
            "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", LATENCY),
            "itl": ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL),
            "tpot": (
                "vllm:request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                ITL,
            ),
            "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY),
            "prompt": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens),
            "gen": ("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens),
        }
        self.h = {k: Histogram(n, d, names, buckets=b, registry=r).labels(*self.lv) for k, (n, d, b) in hist.items()}
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", names, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", names, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", names, registry=r)
        self.per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*names, "position"],
            registry=r,
        )
        for c in (self.prompt_tokens, self.generation_tokens, self.drafts, self.draft_tokens, self.accepted):
            c.labels(*self.lv)  # present from the start, at 0

    def watch(self, kv_usage: Callable[[], float], preemptions: Callable[[], float]) -> None:
        """Read KV usage and preemptions from the engine (the batched engine has both)."""
        self.kv_usage, self.preemptions = kv_usage, preemptions

    def observe(self, result: GenerationResult, ttft_s: float, e2e_s: float) -> None:
        """A finished request (times from its arrival)."""
        n, s = result.num_new_tokens, result.stats
        self.prompt_tokens.labels(*self.lv).inc(result.prompt_tokens)
        self.generation_tokens.labels(*self.lv).inc(n)
        self.success.labels(*self.lv, result.finish_reason.value).inc()
        self.h["prompt"].observe(result.prompt_tokens)
        self.h["gen"].observe(n)
        self.h["e2e"].observe(e2e_s)
        if n:
            self.h["ttft"].observe(ttft_s)
        if n > 1:
            mean = (result.total_s - result.ttft_s) / (n - 1)
            self.h["tpot"].observe(mean)
            for _ in range(n - 1):
                self.h["itl"].observe(mean)
        if s.position_drafted:
            self.drafts.labels(*self.lv).inc(s.position_drafted[0])  # rounds with a non-empty draft
        self.draft_tokens.labels(*self.lv).inc(s.drafted_nodes)
        self.accepted.labels(*self.lv).inc(s.emitted_by_rounds - s.rounds)
        for pos, count in enumerate(s.position_accepted):
            self.per_pos.labels(*self.lv, str(pos)).inc(count)

    def aborted(self) -> None:
        """A request stopped by its client."""
        self.success.labels(*self.lv, "abort").inc()
