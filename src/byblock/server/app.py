"""`byblock serve`'s ASGI app: OpenAI-compatible endpoints over one AsyncEngine, /metrics, /health, playground.

The flow of one request, in one place (`_handle`): validate the body (pydantic) → resolve model, drafter
and sampling params → tokenize and check the context → submit to the engine → stream SSE chunks or wait
for the whole result, aborting the request if the client goes away → metrics + one JSON log line.
Every user error is an OpenAI-style 4xx body; nothing a client sends can crash the server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from byblock import __version__
from byblock.engine.api import check_prompt_fits
from byblock.engine.batched import BatchedEngineCore
from byblock.engine.core import EngineCore, EngineRequest, RequestOutput
from byblock.engine.dllm_batched import DllmBatchedEngineCore
from byblock.engine.types import GenerationResult
from byblock.errors import ByblockError, ContextLengthError
from byblock.models.adapter import TargetModel
from byblock.server.metrics import ServerMetrics
from byblock.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_body
from byblock.server.responses import ChunkFactory, Logprobs, full_response, new_id
from byblock.server.routes import add_utility_routes, require_api_key
from byblock.server.tools import ToolUse, conversation
from byblock.server.worker import AsyncEngine

log = logging.getLogger("byblock.server")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


@dataclass(frozen=True)
class ServerConfig:
    """What the server exposes and its limits."""

    model_name: str  # the id clients put in "model" (optional in a request, as in vLLM)
    default_drafter: str = "none"
    default_max_tokens: int | None = None  # chat requests without max_tokens; None: the rest of the context
    max_tokens_limit: int = 4096  # larger max_tokens is a 400 (a default is capped at it)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>" (else 401)
    max_pending: int | None = None  # requests in the engine (running + queued) past which new ones get a 503
    retry_after_s: int = 1  # the Retry-After of a 503


def _error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    type_ = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def create_app(model: TargetModel, core: EngineCore, config: ServerConfig, engine_thread: bool = True) -> FastAPI:
    """The server app. `core` owns the model from its engine loop; handlers only tokenize. engine_thread=False:
    the caller runs the loop (`app.state.engine.run`), as `byblock serve` does on its main thread."""
    engine = AsyncEngine(core, own_thread=engine_thread)
    metrics = ServerMetrics(core.num_waiting, core.num_running, config.model_name, model.max_context)
    if isinstance(core, (BatchedEngineCore, DllmBatchedEngineCore)):
        metrics.watch_batches(core)
    pending: set[str] = set()  # request ids handed to the engine, not finished (the event loop's: no lock needed)
    if config.default_drafter not in core.drafter_names:
        raise ByblockError(f"default drafter '{config.default_drafter}' is not loaded")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.close()

    app = FastAPI(
        title="byblock", version=__version__, description="OpenAI-compatible block-parallel decoding", lifespan=lifespan
    )
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config

    def rejected(request: Request, status: int, message: str, param: str | None = None, code: str | None = None):
        """An error response, counted and logged like every other request."""
        endpoint = ENDPOINTS.get(request.url.path, "other")
        metrics.requests.labels(endpoint, str(status)).inc()
        log.info(json.dumps({"event": "rejected", "endpoint": endpoint, "status": status, "error": message}))
        return _error(status, message, param, code)

    if config.api_key is not None:
        require_api_key(app, config.api_key, rejected)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return rejected(request, e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        if err.get("type") == "json_invalid":
            return rejected(request, 400, f"request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        msg = f"{where + ': ' if where else ''}{err.get('msg', 'invalid value')}"
        return rejected(request, 400, msg, loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return rejected(request, e.status_code, f"{e.detail}: {request.method} {request.url.path}")

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return rejected(request, 500, f"internal error: {type(e).__name__}")

    def resolve(
        body: CompletionRequest | ChatCompletionRequest, chat: bool, use: ToolUse | None
    ) -> list[EngineRequest]:
        """The body's engine requests: one per choice (`n`), sharing the prompt; choice i samples with seed + i."""
        if body.model is not None and body.model != config.model_name:
            raise ApiError(
                404,
                f"model '{body.model}' is not served here (serving '{config.model_name}')",
                "model",
                "model_not_found",
            )
        drafter = body.drafter or config.default_drafter
        if drafter not in core.drafter_names:
            raise ApiError(
                400, f"drafter '{drafter}' is not loaded (loaded: {', '.join(core.drafter_names)})", "drafter"
            )
        ids = tokenize(body, use)
        try:
            check_prompt_fits(model, ids)
        except ContextLengthError as e:
            raise ApiError(400, str(e), "messages" if chat else "prompt", "context_length_exceeded") from None
        rest = model.max_context - len(ids)  # vLLM's default: the rest of the context
        default = min(config.default_max_tokens or rest, rest, config.max_tokens_limit)
        try:
            params = body.sampling_params(default)
            if use is not None and (forced := use.grammar()) is not None:
                if params.grammar is not None:
                    msg = "tool_choice 'required' or a named tool cannot be combined with a response format"
                    raise ApiError(400, msg, "tool_choice")
                params = replace(params, grammar=forced)
            if params.grammar is not None:
                params.grammar.check()  # here, so a bad schema is a 400 before the request is queued
        except ByblockError as e:
            raise ApiError(400, str(e)) from None
        if params.max_new_tokens > config.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens {params.max_new_tokens} exceeds this server's limit {config.max_tokens_limit}",
                "max_tokens",
            )
        for t in (*(i for i, _ in params.logit_bias), *params.stop_token_ids):
            if t >= model.vocab_size:
                raise ApiError(400, f"token id {t} is outside the vocabulary ({model.vocab_size})")
        base = new_id("req")
        if body.n == 1:
            return [EngineRequest(base, tuple(ids), params, drafter)]
        seeds = [None if params.seed is None else params.seed + i for i in range(body.n)]
        return [
            EngineRequest(f"{base}-{i}", tuple(ids), replace(params, seed=seed), drafter)
            for i, seed in enumerate(seeds)
        ]

    def tokenize(body: CompletionRequest | ChatCompletionRequest, use: ToolUse | None) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                return model.encode_messages(conversation(body.chat_messages(), use))
            except Exception as e:  # a chat template can reject a conversation (e.g. roles out of order)
                raise ApiError(400, f"messages rejected by the chat template: {e}", "messages") from None
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            ids = [int(t) for t in prompt]
            if max(ids) >= model.vocab_size:
                raise ApiError(
                    400, f"prompt token id {max(ids)} is outside the vocabulary ({model.vocab_size})", "prompt"
                )
            return ids
        text = prompt[0] if isinstance(prompt, list) else prompt
        return model.encode_prompt(str(text), chat=False)

    def finish(
        endpoint: str,
        status: str,
        req: EngineRequest,
        arrived: float,
        ttft: float | None,
        result: GenerationResult | None,
        stream: bool,
    ) -> None:
        e2e = time.perf_counter() - arrived
        metrics.requests.labels(endpoint, status).inc()
        if result is not None:
            metrics.observe_result(result, ttft if ttft is not None else e2e, e2e)
        if status == "aborted":
            metrics.aborted.inc()
            metrics.vllm.aborted()
        line = {
            "event": "request",
            "id": req.request_id,
            "endpoint": endpoint,
            "status": status,
            "stream": stream,
            "drafter": req.drafter,
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": result.num_new_tokens if result else 0,
            "finish_reason": result.finish_reason.value if result else None,
            "tau": round(result.stats.mean_accepted, 3) if result and result.stats.rounds else None,
            "ttft_s": round(ttft, 4) if ttft is not None else None,
            "e2e_s": round(e2e, 4),
        }
        log.info(json.dumps(line))

    def overloaded(request: Request) -> JSONResponse:
        """503 + Retry-After: the engine holds max_pending requests (vLLM/OpenAI clients retry on it)."""
        response = rejected(
            request, 503, f"the server is at capacity ({config.max_pending} requests); retry later", None, "overloaded"
        )
        response.headers["Retry-After"] = str(config.retry_after_s)
        return response

    def token_text(token: int) -> str:
        return model.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def handle(body: CompletionRequest | ChatCompletionRequest, http: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        use = ToolUse.parse(body.tools, body.tool_choice) if isinstance(body, ChatCompletionRequest) else None
        reqs = resolve(body, chat, use)
        if config.max_pending is not None and len(pending) + len(reqs) > config.max_pending:
            return overloaded(http)
        ids = [r.request_id for r in reqs]
        pending.update(ids)
        lp = Logprobs(chat, token_text) if reqs[0].params.logprobs is not None else None
        if body.stream:  # released by the stream's end, or after the response if the stream never started
            return StreamingResponse(
                stream(reqs, chat, body.include_usage, arrived, endpoint, lp, use),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(pending.difference_update, ids),
            )
        try:
            return await respond(reqs, http, chat, arrived, endpoint, lp, use)
        finally:
            pending.difference_update(ids)

    async def merged(reqs: list[EngineRequest]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's outputs as they come, tagged with the choice index; leaving early aborts them all."""
        if len(reqs) == 1:  # the common case, without tasks
            async for out in engine.generate(reqs[0]):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

        async def pump(i: int, req: EngineRequest) -> None:
            try:
                async for out in engine.generate(req):
                    await queue.put((i, out))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            open_ = len(tasks)
            while open_:
                i, out = await queue.get()
                if out is None:
                    open_ -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def respond(
        reqs: list[EngineRequest],
        http: Request,
        chat: bool,
        arrived: float,
        endpoint: str,
        lp: Logprobs | None,
        use: ToolUse | None,
    ) -> Response:
        """A non-streamed request: wait for every choice's result, aborting them if the client goes away."""
        ttft: list[float | None] = [None] * len(reqs)
        results: list[GenerationResult | None] = [None] * len(reqs)
        failure: RequestOutput | None = None

        async def collect() -> None:
            nonlocal failure
            async for i, out in merged(reqs):
                if out.event is not None and ttft[i] is None:
                    ttft[i] = time.perf_counter() - arrived
                results[i] = out.result or results[i]
                failure = out if out.error is not None else failure

        task = asyncio.ensure_future(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                for i, req in enumerate(reqs):
                    finish(endpoint, "aborted", req, arrived, ttft[i], None, False)
                return Response(status_code=499)
        task.result()
        if failure is not None or any(r is None for r in results):
            for i, req in enumerate(reqs):
                finish(endpoint, "error", req, arrived, ttft[i], None, False)
            if failure is None:
                return _error(500, "generation ended without a result")
            return _error(500 if failure.internal else 400, failure.error or "generation failed")
        done = [r for r in results if r is not None]
        for i, (req, result) in enumerate(zip(reqs, done, strict=True)):
            finish(endpoint, "ok", req, arrived, ttft[i], result, False)
        return JSONResponse(full_response(chat, config.model_name, done, lp, use.calls if use else None))

    async def stream(
        reqs: list[EngineRequest],
        chat: bool,
        include_usage: bool,
        arrived: float,
        endpoint: str,
        lp: Logprobs | None,
        use: ToolUse | None,
    ) -> AsyncIterator[bytes]:
        chunks = ChunkFactory(chat, config.model_name, lp)
        ttft: list[float | None] = [None] * len(reqs)
        results: list[GenerationResult | None] = [None] * len(reqs)
        status = "aborted"
        try:
            first = chunks.first(len(reqs))
            if first is not None:
                yield _sse(first)
            async for i, out in merged(reqs):
                if out.error is not None:
                    status = "error"
                    yield _sse(error_body(out.error, "internal_error" if out.internal else "invalid_request_error"))
                    break
                if out.event is not None:
                    ttft[i] = ttft[i] if ttft[i] is not None else time.perf_counter() - arrived
                    if use is None:  # with tools the text is sent once decided (server/tools.py)
                        yield _sse(chunks.delta(i, out.event))
                if out.result is not None:
                    results[i] = out.result
                    if use is not None:
                        content, calls = use.calls(out.result.text)
                        for chunk in chunks.tool_turn(i, content, calls):
                            yield _sse(chunk)
                        yield _sse(chunks.final(i, out.result, "tool_calls" if calls else None))
                    else:
                        yield _sse(chunks.final(i, out.result))
            else:
                if include_usage:
                    yield _sse(chunks.usage([r for r in results if r is not None]))
                status = "ok"
            yield _sse("[DONE]")
        finally:
            pending.difference_update(r.request_id for r in reqs)
            for i, req in enumerate(reqs):
                finish(endpoint, status, req, arrived, ttft[i], results[i] if status == "ok" else None, True)

    @app.post("/v1/completions", summary="OpenAI completions (byblock extension: `drafter`)")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handle(body, request, chat=False)

    @app.post("/v1/chat/completions", summary="OpenAI chat completions (byblock extension: `drafter`)")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await handle(body, request, chat=True)

    add_utility_routes(app, model, config)

    @app.get("/v1/models", summary="The served model and its loaded drafters")
    async def models() -> dict[str, Any]:
        entry = {
            "id": config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "byblock",
            "max_model_len": model.max_context,
            "byblock": {"drafters": list(core.drafter_names), "default_drafter": config.default_drafter},
        }
        return {"object": "list", "data": [entry]}

    @app.get("/health", summary="Liveness: 200 while the engine thread runs")
    async def health() -> Response:
        alive = engine.alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse, summary="The playground page")
    async def playground() -> HTMLResponse:
        return HTMLResponse(resources.files("byblock.server").joinpath("playground.html").read_text("utf-8"))

    return app
