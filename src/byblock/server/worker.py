"""The bridge between asyncio request handlers and an EngineCore that runs on its own thread.

Handlers call `AsyncEngine.generate(request)` and iterate RequestOutputs; the engine thread owns the model
and is the only thread that touches it. Leaving the iteration early (client disconnect, cancelled task)
aborts the request in the engine, so its decoding stops at the next step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from byblock.engine.core import EngineCore, EngineRequest, RequestOutput
from byblock.models.host_memory import release_freed_memory


@dataclass
class _Listener:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput]


class AsyncEngine:
    """Runs an EngineCore on a daemon thread and fans its outputs out to asyncio queues."""

    def __init__(self, core: EngineCore, own_thread: bool = True) -> None:
        """own_thread=False: the caller runs the engine loop on its own thread (`run`), e.g. the main thread:
        torch's OpenMP workers then stay one pool; a second pool (an engine thread beside the main thread that
        loaded the model) makes libgomp throttle its spin-waits, and every parallel region then pays a futex
        wake-up (a 16-request decode step measured 1.7x slower, dev/LOG.md session 23)."""
        self.core = core
        self._own_thread = own_thread
        self._inbox: queue.Queue[tuple[str, EngineRequest | str]] = queue.Queue()
        self._listeners: dict[str, _Listener] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running_here = False
        self.start()

    def start(self) -> None:
        """Start the engine thread (no-op while it runs, or when the caller runs the loop; an ASGI lifespan may
        stop and start it again)."""
        if not self._own_thread or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="byblock-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until the finished one; leaving early aborts it."""
        listener = _Listener(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._listeners[request.request_id] = listener
        self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                out = await listener.outputs.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._listeners.pop(request.request_id, None)
            if not finished:
                self._inbox.put(("abort", request.request_id))

    def alive(self) -> bool:
        """True while the engine loop runs."""
        if not self._own_thread:
            return self._running_here
        return self._thread is not None and self._thread.is_alive()

    def run(self, should_stop) -> None:
        """Run the engine loop on the calling thread until `should_stop()` (checked at least twice a second)."""
        self._running_here = True
        try:
            while not should_stop():
                self._drain(block=not self.core.has_unfinished())
                if self.core.has_unfinished():
                    self._step()
        finally:
            self._running_here = False

    def close(self) -> None:
        """Stop the engine thread after its current step (queued requests stay queued for a restart)."""
        self._stop.set()
        self._inbox.put(("wake", ""))
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                assert isinstance(item, EngineRequest)
                self.core.add_request(item)
            elif kind == "abort":
                assert isinstance(item, str)
                self.core.abort_request(item)

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self._drain(block=not self.core.has_unfinished())
            if self.core.has_unfinished():
                self._step()

    def _step(self) -> None:
        for out in self.core.step():
            with self._lock:
                listener = self._listeners.get(out.request_id)
            if listener is not None:
                listener.loop.call_soon_threadsafe(listener.outputs.put_nowait, out)
        if not self.core.has_unfinished():
            release_freed_memory()  # gone idle: the finished requests' caches go back to the OS, not to malloc
