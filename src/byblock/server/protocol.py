"""OpenAI wire format: request bodies (validated by pydantic, so they also define the OpenAPI schema) and
the response / chunk / error objects byblock sends back.

byblock extensions are plain extra fields, which OpenAI clients ignore: `drafter` on requests (pass it with
`extra_body={"drafter": "ngram"}`), `byblock` on responses and stream chunks (which tokens came from an
accepted draft, τ, tokens/s).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from byblock.engine.types import GenerationResult, StreamEvent
from byblock.errors import InvalidParameterError
from byblock.sampling.params import SamplingParams

MAX_STOP = 4  # OpenAI's limit on stop sequences


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage is meaningful."""

    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")  # clients send fields we do not need (user, metadata, ...)

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] = 0.0
    logprobs: Literal[False] | None = None
    drafter: str | None = Field(None, description="byblock: which loaded drafter decodes this request")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (raises InvalidParameterError with a one-line message)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop):
            raise InvalidParameterError("stop strings must be non-empty")
        return SamplingParams(
            max_new_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=stop,
        )

    def requested_max_tokens(self) -> int | None:
        """The client's token limit, if any."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: (
        str
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions
    echo: Literal[False] = False


class TextPart(BaseModel):
    """A text content part of a chat message."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat turn."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The message's text (content parts concatenated)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """role/content dicts for the chat template ('developer' is OpenAI's newer name for 'system')."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(result: GenerationResult) -> dict[str, int]:
    """OpenAI usage counts."""
    n = result.num_new_tokens
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


def result_extension(result: GenerationResult) -> dict[str, Any]:
    """The `byblock` field of a finished response: how the block-parallel decode went."""
    s = result.stats
    return {
        "drafter": result.drafter,
        "tau": round(s.mean_accepted, 4),
        "rounds": s.rounds,
        "draft_tokens": sum(result.from_draft),
        "from_draft": [int(x) for x in result.from_draft],
        "ttft_s": round(result.ttft_s, 6),
        "total_s": round(result.total_s, 6),
        "tokens_per_s": round(result.tokens_per_s, 3),
    }


def event_extension(event: StreamEvent) -> dict[str, Any]:
    """The `byblock` field of a stream chunk: which of the delta's tokens came from an accepted draft."""
    return {"from_draft": [int(t.from_draft) for t in event.tokens], "elapsed_s": round(event.elapsed_s, 6)}


class ChunkFactory:
    """Builds the chunks of one streamed response (same id and creation time on every chunk)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def first(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role and empty content."""
        return self._wrap([self._choice("", None, role=True)]) if self.chat else None

    def delta(self, event: StreamEvent) -> dict[str, Any]:
        """A text delta."""
        return self._wrap([self._choice(event.text, None)], byblock=event_extension(event))

    def final(self, result: GenerationResult) -> dict[str, Any]:
        """The chunk that carries finish_reason (and byblock's summary)."""
        return self._wrap(
            [self._choice(None if self.chat else "", result.finish_reason.value)], byblock=result_extension(result)
        )

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        """The trailing usage chunk (stream_options.include_usage)."""
        return self._wrap([], usage=usage(result))


def full_response(chat: bool, model: str, result: GenerationResult) -> dict[str, Any]:
    """A non-streamed response object."""
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": result.text},
            "logprobs": None,
            "finish_reason": result.finish_reason.value,
        }
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason.value}
    return {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(result),
        "byblock": result_extension(result),
    }
