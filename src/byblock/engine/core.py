"""The step-wise engine a server drives: requests go in, per-step outputs come out.

`EngineCore` is the contract (vLLM/nano-vllm style: add_request / abort_request / step). The server only
ever talks to this contract, so a batched engine — several sequences per verify forward, each accepting a
different number of tokens — can replace `SerialEngineCore` without touching the server.

`SerialEngineCore` runs one request at a time, first come first served, and advances it by one text delta
per `step()`. One request at a time is what makes concurrent clients exact: every request runs alone on
the model, with its own generator, so it produces the same tokens it would produce alone (same seed, same
text) — CPU kernels are not batch-invariant, so mixing rows from different requests into one forward would
break that (see dev/LOG.md on bf16 row-count effects).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Protocol

from byblock.drafters.base import Drafter
from byblock.engine.api import Generation
from byblock.engine.types import GenerationResult, StreamEvent
from byblock.errors import ByblockError
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine sees it: already tokenized and validated."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    drafter: str = "none"  # a key of the engine's drafters ("none": plain decoding)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: a text delta, or the end (result or error)."""

    request_id: str
    event: StreamEvent | None = None
    result: GenerationResult | None = None  # set on the request's last output
    error: str | None = None  # set instead of result when the request failed
    internal: bool = False  # the failure is byblock's bug, not the request's fault (HTTP 500, not 400)

    @property
    def finished(self) -> bool:
        """True on the last output of a request."""
        return self.result is not None or self.error is not None


class EngineCore(Protocol):
    """The engine contract the server drives from one thread."""

    drafter_names: tuple[str, ...]

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Drop a request, queued or running; it produces no further output."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request is queued or running."""
        ...

    def num_waiting(self) -> int:
        """Requests queued but not started."""
        ...

    def num_running(self) -> int:
        """Requests being decoded."""
        ...

    def step(self) -> list[RequestOutput]:
        """Advance decoding; return the outputs this step produced (possibly none)."""
        ...


class FifoEngineCore:
    """One request at a time, first come first served. Subclasses say how a request turns into outputs
    (`_outputs`: a generator of RequestOutputs ending with the finished one); this class owns the queue and
    pulls one output per step. Closing that generator (abort) closes the request's decode loop mid-block."""

    drafter_names: tuple[str, ...] = ("none",)

    def __init__(self) -> None:
        self._waiting: deque[EngineRequest] = deque()
        self._running: tuple[EngineRequest, Generator[RequestOutput, None, None]] | None = None

    def _outputs(self, req: EngineRequest) -> Generator[RequestOutput, None, None]:
        raise NotImplementedError

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (problems with it surface when it starts, as an error output)."""
        self._waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Drop a queued request, or stop the running one."""
        if self._running is not None and self._running[0].request_id == request_id:
            self._running[1].close()
            self._running = None
            return
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)

    def has_unfinished(self) -> bool:
        """True while a request is queued or running."""
        return self._running is not None or bool(self._waiting)

    def num_waiting(self) -> int:
        """Requests queued behind the running one."""
        return len(self._waiting)

    def num_running(self) -> int:
        """0 or 1."""
        return int(self._running is not None)

    def step(self) -> list[RequestOutput]:
        """Start the next request if idle, then pull its next output."""
        if self._running is None:
            if not self._waiting:
                return []
            req = self._waiting.popleft()
            self._running = (req, self._outputs(req))
        req, outputs = self._running
        try:
            out = next(outputs)
        except StopIteration:
            self._running = None
            return []
        except ByblockError as e:
            self._running = None
            return [RequestOutput(req.request_id, error=str(e))]
        except Exception as e:  # a bug must fail one request, never the engine thread
            self._running = None
            return [RequestOutput(req.request_id, error=f"internal error: {type(e).__name__}: {e}", internal=True)]
        if out.finished:
            self._running = None
        return [out]


class SerialEngineCore(FifoEngineCore):
    """Autoregressive requests (plain or speculative), one at a time; each step yields the next text delta."""

    def __init__(self, model: TargetModel, drafters: Mapping[str, Drafter | None]) -> None:
        super().__init__()
        self.model = model
        self.drafters = {"none": None, **drafters}
        self.drafter_names = tuple(self.drafters)

    def _outputs(self, req: EngineRequest) -> Generator[RequestOutput, None, None]:
        if req.drafter not in self.drafters:
            raise ByblockError(f"drafter '{req.drafter}' is not loaded")
        gen = Generation(self.model, list(req.prompt_ids), req.params, self.drafters[req.drafter])
        events = iter(gen)
        try:
            for event in events:
                yield RequestOutput(req.request_id, event=event)
        finally:
            events.close()  # type: ignore[attr-defined]
        assert gen.result is not None
        yield RequestOutput(req.request_id, result=gen.result)
