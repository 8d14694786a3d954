"""llama.cpp as a peer byblock measures against: `llama-server` in a child process, fed byblock's prompt token
ids over its native `/completion` endpoint (`"prompt": [ids]`, `"return_tokens": true`), one HTTP request per
prompt, a batch sent concurrently to as many server slots (`-np`).

The binary is `$BYBLOCK_LLAMA_SERVER` or --llama-server: llama.cpp built from source (the commit llama-cpp-python
0.3.36 vendors has `--spec-type draft-dflash`; dev/LOG.md has the build line that works on these hosts).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from byblock.errors import ByblockError

START_TIMEOUT_S = 300


def find_llama_server(explicit: str | None = None) -> Path:
    """The llama-server binary: --llama-server, else $BYBLOCK_LLAMA_SERVER."""
    text = explicit or os.environ.get("BYBLOCK_LLAMA_SERVER")
    if not text or not Path(text).expanduser().is_file():
        raise ByblockError(
            f"no llama-server binary at {text or '(unset)'}: build llama.cpp (see docs/handoff.md) and pass "
            "--llama-server or set BYBLOCK_LLAMA_SERVER"
        )
    return Path(text).expanduser().absolute()


LOOKUP_NGRAM = 3


@dataclass(frozen=True)
class LlamaCppConfig:
    """What llama-server loads."""

    target_gguf: str
    draft_gguf: str | None = None  # byblock export --format llamacpp; None = plain
    spec_type: str = "draft-dflash"  # the draft GGUF's: draft-dflash | draft-eagle3
    k: int = 15  # --spec-draft-n-max
    slots: int = 1  # -np: concurrent sequences
    lookup_k: int = 0  # > 0: llama.cpp's prompt lookup (ngram-simple) drafting this many tokens; needs no draft
    ctx_per_slot: int = 2048
    threads: int = os.cpu_count() or 1


@dataclass(frozen=True)
class LlamaCppOutput:
    """One request's answer as llama-server reports it."""

    ids: list[int]
    ttft_s: float
    total_s: float
    drafted: int  # draft tokens proposed (timings.draft_n)
    accepted: int  # of those, accepted (timings.draft_n_accepted)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppPeer:
    """A running llama-server; `generate` sends a batch concurrently, `close` ends it."""

    def __init__(self, cfg: LlamaCppConfig, binary: Path, eos_ids: frozenset[int]) -> None:
        self.cfg, self.eos = cfg, eos_ids
        self.port = _free_port()
        argv = [str(binary), "-m", cfg.target_gguf, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["-t", str(cfg.threads), "-np", str(cfg.slots), "-c", str(cfg.ctx_per_slot * cfg.slots)]
        if cfg.draft_gguf:
            argv += ["-md", cfg.draft_gguf, "--spec-type", cfg.spec_type, "--spec-draft-n-max", str(cfg.k)]
        elif cfg.lookup_k:
            # n-grams of 3, as byblock's ngram drafter matches (llama.cpp's default, 12, rarely matches in chat)
            argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LOOKUP_NGRAM)]
            argv += ["--spec-ngram-simple-size-m", str(cfg.lookup_k)]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="byblock-llamacpp-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise self._fail("exited during start-up")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        else:
            raise self._fail(f"did not answer /health within {START_TIMEOUT_S} s")
        self.version = "llama.cpp " + self._build_info()

    def _build_info(self) -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=10) as r:
                return str(json.loads(r.read()).get("build_info", "?"))
        except (urllib.error.URLError, OSError, ValueError):
            return "?"

    def _fail(self, what: str) -> ByblockError:
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-6:]
        self.close()
        return ByblockError(f"llama-server {what} (log {self.log.name}): " + " | ".join(tail)[-800:])

    def _one(self, ids: list[int], body: dict) -> LlamaCppOutput:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion",
            data=json.dumps({**body, "prompt": ids}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=3600) as r:
            d = json.loads(r.read())
        t = d["timings"]
        toks = list(d["tokens"])
        if d.get("stop_type") == "eos" and (not toks or toks[-1] not in self.eos):
            toks.append(min(self.eos))  # byblock's answers end with the EOS they stopped at; llama.cpp drops it
        ttft = t["prompt_ms"] / 1e3
        drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
        return LlamaCppOutput(toks, ttft, ttft + t["predicted_ms"] / 1e3, drafted, accepted)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> tuple[list[LlamaCppOutput], float]:
        """Decode a batch (concurrent requests, one per slot); returns the answers and the batch's wall time."""
        if len(prompts) > self.cfg.slots:
            raise ByblockError(f"a batch of {len(prompts)} needs {len(prompts)} llama-server slots")
        body = {"n_predict": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": 0}
        body.update(cache_prompt=False, return_tokens=True, seed=-1 if seed is None else seed)
        t = time.perf_counter()
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda ids: self._one(ids, body), prompts))
        except (urllib.error.URLError, OSError) as e:
            raise self._fail(f"request failed ({e})") from None
        return outs, time.perf_counter() - t

    def close(self) -> None:
        """Stop the server."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
