"""A closed-loop load generator for `byblock serve` (or any OpenAI-compatible server).

`concurrency` clients each send one streamed request at a time — a chat completion, or a raw completion for
prompts like HumanEval's (`completions`) — until `requests` have been sent or `duration_s` has passed (bounded
both ways). Time to first token is measured by the client: from sending the request to the first content chunk,
queueing in the server included — what a user waits.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from byblock.bench.datasets import Prompt
from byblock.errors import ByblockError


@dataclass(frozen=True)
class LoadConfig:
    """One load run: every (drafter, concurrency) level over the same prompts."""

    url: str
    model: str
    prompts: tuple[str, ...]
    drafters: tuple[str, ...] = ("none",)
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 16  # per level
    duration_s: float = 300.0  # per level: no new requests after this
    max_tokens: int = 64
    temperature: float = 0.0
    timeout_s: float = 600.0
    completions: bool = False  # raw prompts to /v1/completions (code completion), else chat to /v1/chat/completions


def prompt_texts(rows: list[Prompt]) -> tuple[tuple[str, ...], bool]:
    """The prompts' texts, and whether they go to /v1/completions (raw rows, `chat` false: HumanEval's) rather
    than /v1/chat/completions. One kind per run: an empty or mixed set is a one-line error."""
    if not rows:
        raise ByblockError("no prompts to send")
    if len({p.chat for p in rows}) > 1:
        raise ByblockError("the prompts mix chat and raw completion rows; loadgen sends one kind per run")
    return tuple(p.text for p in rows), not rows[0].chat


def describe_prompts(count: int, dataset: str, completions: bool) -> str:
    """What a run sent, for its RESULTS.md line (e.g. '32 HumanEval prompts as raw completions')."""
    what = "HumanEval" if dataset == "humaneval" else "dev"
    return f"{count} {what} prompts as {'raw completions' if completions else 'chat requests'}"


@dataclass(frozen=True)
class Sample:
    """One request as the client saw it."""

    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    completion_tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class LevelResult:
    """All requests of one (drafter, concurrency) level."""

    drafter: str
    concurrency: int
    wall_s: float
    samples: tuple[Sample, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> list[Sample]:
        """Successful requests."""
        return [s for s in self.samples if s.ok]

    @property
    def throughput(self) -> float:
        """Completion tokens per second of wall time, all clients together."""
        return sum(s.completion_tokens for s in self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    def pct(self, attr: str, q: float) -> float:
        """Percentile q (0-100) of a Sample attribute over successful requests (linear interpolation)."""
        vals = [getattr(s, attr) for s in self.ok]
        return float(np.percentile(vals, q)) if vals else float("nan")

    def to_json(self) -> dict:
        """Summary numbers of the level."""
        return {
            "drafter": self.drafter,
            "concurrency": self.concurrency,
            "requests": len(self.samples),
            "errors": len(self.samples) - len(self.ok),
            "wall_s": round(self.wall_s, 3),
            "throughput_tok_s": round(self.throughput, 3),
            "requests_per_s": round(len(self.ok) / self.wall_s, 4) if self.wall_s else 0.0,
            "ttft_p50_s": round(self.pct("ttft_s", 50), 4),
            "ttft_p99_s": round(self.pct("ttft_s", 99), 4),
            "e2e_p50_s": round(self.pct("e2e_s", 50), 4),
            "completion_tokens": sum(s.completion_tokens for s in self.ok),
        }


def _content(choice: dict) -> str | None:
    """A streamed choice's new text: a chat chunk's delta content, or a completion chunk's text."""
    return choice["delta"].get("content") if "delta" in choice else choice.get("text")


async def one_request(client: httpx.AsyncClient, cfg: LoadConfig, drafter: str, prompt: str, seed: int) -> Sample:
    """Send one streamed (chat) completion; time its first content chunk and its end."""
    body = {
        "model": cfg.model,
        **({"prompt": prompt} if cfg.completions else {"messages": [{"role": "user", "content": prompt}]}),
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "drafter": drafter,
    }
    start = time.perf_counter()
    ttft, tokens = None, 0
    try:
        path = "/v1/completions" if cfg.completions else "/v1/chat/completions"
        async with client.stream("POST", cfg.url + path, json=body) as r:
            if r.status_code != 200:
                return Sample(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(ok=False, error=chunk["error"].get("message", "error"))
                if ttft is None and chunk.get("choices") and _content(chunk["choices"][0]):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return Sample(ok=False, error=f"{type(e).__name__}: {e}")
    e2e = time.perf_counter() - start
    return Sample(ok=True, ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e, completion_tokens=tokens)


async def run_level(cfg: LoadConfig, drafter: str, concurrency: int) -> LevelResult:
    """`concurrency` closed-loop clients until cfg.requests are sent or cfg.duration_s has passed."""
    samples: list[Sample] = []
    next_index = 0
    start = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < cfg.requests and time.perf_counter() - start < cfg.duration_s:
            i = next_index
            next_index += 1
            samples.append(await one_request(client, cfg, drafter, cfg.prompts[i % len(cfg.prompts)], seed=i))

    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as client:
        await one_request(client, cfg, drafter, cfg.prompts[0], seed=0)  # warm-up, not counted
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return LevelResult(drafter, concurrency, time.perf_counter() - start, tuple(samples))


def run_load(cfg: LoadConfig, progress=None) -> list[LevelResult]:
    """Every level, drafters interleaved per concurrency (so machine drift hits them alike)."""
    results = []
    for c in cfg.concurrency:
        for d in cfg.drafters:
            res = asyncio.run(run_level(cfg, d, c))
            results.append(res)
            if progress is not None:
                progress(res)
    return results


def markdown_table(results: list[LevelResult], baseline: str = "none") -> str:
    """The RESULTS.md table: one row per level, throughput also as a ratio to the baseline drafter."""
    base = {r.concurrency: r.throughput for r in results if r.drafter == baseline}
    lines = [
        "| drafter | clients | requests (errors) | throughput tok/s | vs plain | TTFT p50 s | TTFT p99 s | e2e p50 s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        j = r.to_json()
        ratio = r.throughput / base[r.concurrency] if base.get(r.concurrency) else float("nan")
        lines.append(
            f"| {r.drafter} | {r.concurrency} | {j['requests']} ({j['errors']}) | {j['throughput_tok_s']:.1f} | "
            f"{ratio:.2f}× | {j['ttft_p50_s']:.2f} | {j['ttft_p99_s']:.2f} | {j['e2e_p50_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"
