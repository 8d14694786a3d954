"""OpenAI wire format, requests: the bodies (validated by pydantic, so they also define the OpenAPI schema),
their translation into SamplingParams, and the error object. Responses and stream chunks: server/responses.py.

byblock extensions are plain extra fields, which OpenAI clients ignore: `drafter` on requests (pass it with
`extra_body={"drafter": "ngram"}`), `byblock` on responses and stream chunks (which tokens came from an
accepted draft, τ, tokens/s).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from byblock.errors import InvalidParameterError
from byblock.sampling.grammar import Grammar, GrammarKind
from byblock.sampling.params import MAX_LOGPROBS, SamplingParams

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 16  # choices per request (each one is an engine request)


class StreamOptions(BaseModel):
    """`stream_options`: only include_usage is meaningful."""

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        """The constraint it asks for (None: free text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Grammar(GrammarKind.JSON_OBJECT)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidParameterError("response_format json_schema needs json_schema.schema")
        return Grammar.json_schema(self.json_schema.schema_)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_grammar(self) -> Grammar:
        """The one constraint given."""
        given = [
            (k, v)
            for k, v in (
                ("json", self.json_),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise InvalidParameterError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
            )
        kind, v = given[0]
        if kind == "json":
            return Grammar.json_schema(v)  # type: ignore[arg-type]
        if kind == "json_object":
            return Grammar(GrammarKind.JSON_OBJECT)
        if kind == "choice":
            return Grammar(GrammarKind.CHOICE, json.dumps(v))
        return Grammar(GrammarKind(kind), v)  # type: ignore[arg-type]


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, plus vLLM's extra sampling fields
    (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos), which clients pass with `extra_body`."""

    model_config = ConfigDict(extra="ignore")  # clients send fields we do not need (user, metadata, ...)

    model: str | None = None  # optional, as in vLLM: the served model when absent
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM: -1 or 0 disables
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
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
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple((self.logit_bias or {}).items()),  # keys: token ids as strings (checked there)
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            grammar=self.grammar(),
        )

    def grammar(self) -> Grammar | None:
        """The structured-output constraint: response_format (OpenAI) or structured_outputs (vLLM), not both."""
        fmt = self.response_format.grammar() if self.response_format is not None else None
        if self.structured_outputs is None:
            return fmt
        if fmt is not None:
            raise InvalidParameterError("give response_format or structured_outputs, not both")
        return self.structured_outputs.to_grammar()

    def num_logprobs(self) -> int | None:
        """Alternatives per token to return (None: no logprobs)."""
        raise NotImplementedError

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
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # legacy: alternatives per token

    def num_logprobs(self) -> int | None:
        """The legacy `logprobs` integer."""
        return self.logprobs


class TextPart(BaseModel):
    """A text content part of a chat message."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat turn. Tool results (role `tool`) and assistant turns without content (`content: null`, e.g. one
    that only called tools) are accepted: the chat template sees their text, "" when there is none."""

    model_config = ConfigDict(extra="ignore")  # name, tool_call_id ...

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's past calls (server/tools.py renders them)

    def text(self) -> str:
        """The message's text (content parts concatenated)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def num_logprobs(self) -> int | None:
        """`logprobs: true` with `top_logprobs` alternatives (OpenAI: top_logprobs needs logprobs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        """role/content dicts ('developer' is OpenAI's newer name for 'system'), with an assistant turn's
        tool_calls where it has them (server/tools.py conversation() makes template turns of them)."""
        turns: list[dict[str, Any]] = []
        for m in self.messages:
            turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                turn["tool_calls"] = m.tool_calls
            turns.append(turn)
        return turns


class ApiError(Exception):
    """A request error that becomes an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
