"""The server's small endpoints beside generation, as vLLM names them: /tokenize, /detokenize, /version, and
the `--api-key` check in front of /v1/*, /tokenize and /detokenize."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from byblock import __version__
from byblock.models.adapter import TargetModel
from byblock.server.protocol import ApiError, ChatMessage

PROTECTED = ("/v1/", "/tokenize", "/detokenize")  # /health, /metrics, /version and the playground stay open


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or chat messages rendered by the chat template (vLLM's two forms)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the prompt form: BOS etc. as a completion request would get them


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


def require_api_key(app: FastAPI, key: str, rejected) -> None:
    """401 unless `Authorization: Bearer <key>` on the protected paths (rejected: the app's error response)."""
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def _check(request: Request, call_next):
        if request.url.path.startswith(PROTECTED):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return rejected(request, 401, "invalid or missing API key", None, "invalid_api_key")
        return await call_next(request)


def add_utility_routes(app: FastAPI, model: TargetModel, config) -> None:
    """Register /tokenize, /detokenize and /version on `app` (config: the ServerConfig)."""

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise ApiError(
                404, f"model '{name}' is not served here (serving '{config.model_name}')", "model", "model_not_found"
            )

    @app.post("/tokenize", summary="Token ids of a prompt or of chat messages (vLLM's /tokenize)")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
            try:
                ids = model.encode_messages(msgs)
            except Exception as e:  # the chat template can refuse a conversation
                raise ApiError(400, f"messages rejected by the chat template: {e}", "messages") from None
        else:
            ids = (
                model.encode_prompt(body.prompt or "", chat=False)
                if body.add_special_tokens
                else (model.tokenizer.encode(body.prompt or "", add_special_tokens=False))
            )
        return {"count": len(ids), "max_model_len": model.max_context, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", summary="Text of token ids (vLLM's /detokenize)")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.tokens and max(body.tokens) >= model.vocab_size:
            raise ApiError(400, f"token id {max(body.tokens)} is outside the vocabulary ({model.vocab_size})", "tokens")
        return {"prompt": model.tokenizer.decode(body.tokens)}

    @app.get("/version", summary="byblock's version")
    async def version() -> dict[str, str]:
        return {"version": __version__}
