"""OpenAI wire format, responses: completion objects, stream chunks, usage, logprobs, for n choices.

byblock extensions are plain extra fields, which OpenAI clients ignore: `byblock` on responses and stream
chunks (which tokens came from an accepted draft, τ, tokens/s).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from byblock.engine.types import GenerationResult, StreamEvent, TokenEvent
from byblock.sampling.logprobs import TokenLogprob

TokenText = Callable[[int], str]  # a token id's text, as logprobs show it


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(results: Sequence[GenerationResult]) -> dict[str, int]:
    """OpenAI usage counts of one request's choices (the prompt is counted once)."""
    prompt = results[0].prompt_tokens
    n = sum(r.num_new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}


def result_extension(result: GenerationResult) -> dict[str, Any]:
    """The `byblock` field of a finished choice: how the block-parallel decode went."""
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


class Logprobs:
    """Formats token logprobs the way each endpoint's clients read them."""

    def __init__(self, chat: bool, text: TokenText) -> None:
        self.chat = chat
        self.text = text

    def _entry(self, token: int, lp: float) -> dict[str, Any]:
        s = self.text(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def format(self, tokens: Sequence[int], lps: Sequence[TokenLogprob | None], offset: int = 0) -> dict[str, Any]:
        """chat: {"content": [{token, logprob, bytes, top_logprobs}]}; completions: the legacy
        {tokens, token_logprobs, top_logprobs, text_offset} (offset: characters before the first token)."""
        pairs = [(t, lp) for t, lp in zip(tokens, lps, strict=True) if lp is not None]
        if self.chat:
            content = [
                {**self._entry(t, lp.logprob), "top_logprobs": [self._entry(i, v) for i, v in lp.top]}
                for t, lp in pairs
            ]
            return {"content": content}
        strings = [self.text(t) for t, _ in pairs]
        offsets, at = [], offset
        for s in strings:
            offsets.append(at)
            at += len(s)
        return {
            "tokens": strings,
            "token_logprobs": [lp.logprob for _, lp in pairs],
            "top_logprobs": [{self.text(i): v for i, v in lp.top} for _, lp in pairs],
            "text_offset": offsets,
        }


class ChunkFactory:
    """Builds the chunks of one streamed response (same id and creation time on every chunk)."""

    def __init__(self, chat: bool, model: str, logprobs: Logprobs | None) -> None:
        """logprobs: the formatter when the request asked for logprobs, else None."""
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # choice -> characters streamed so far (completions' text_offset)

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _choice(
        self, index: int, text: str | None, finish: str | None, role: bool = False, lp: Any = None
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}

    def first(self, n: int) -> dict[str, Any] | None:
        """Chat streams open with the assistant role and empty content, for every choice."""
        return self._wrap([self._choice(i, "", None, role=True) for i in range(n)]) if self.chat else None

    def delta(self, index: int, event: StreamEvent) -> dict[str, Any]:
        """A text delta of choice `index` (with its tokens' logprobs when asked for)."""
        lp = None
        if self.logprobs is not None:
            toks: tuple[TokenEvent, ...] = event.tokens
            at = self._offsets.get(index, 0)
            lp = self.logprobs.format([t.token_id for t in toks], [t.logprob for t in toks], at)
            self._offsets[index] = at + len(event.text)
        return self._wrap([self._choice(index, event.text, None, lp=lp)], byblock=event_extension(event))

    def final(self, index: int, result: GenerationResult, finish: str | None = None) -> dict[str, Any]:
        """The chunk that carries choice `index`'s finish_reason (and byblock's summary); finish: instead of the
        result's (e.g. "tool_calls")."""
        choice = self._choice(index, None if self.chat else "", finish or result.finish_reason.value)
        return self._wrap([choice], byblock=result_extension(result))

    def tool_turn(self, index: int, content: str | None, calls: Sequence[Any]) -> list[dict[str, Any]]:
        """A decided turn of a request with tools: its content delta, then its tool_calls delta."""
        chunks = []
        if content:
            chunks.append(self._wrap([self._choice(index, content, None)]))
        if calls:
            delta = {"tool_calls": [c.to_json(j) for j, c in enumerate(calls)]}
            chunks.append(self._wrap([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]))
        return chunks

    def usage(self, results: Sequence[GenerationResult]) -> dict[str, Any]:
        """The trailing usage chunk (stream_options.include_usage)."""
        return self._wrap([], usage=usage(results))


def full_response(
    chat: bool,
    model: str,
    results: Sequence[GenerationResult],
    logprobs: Logprobs | None,
    tool_calls: Callable[[str], tuple[str | None, list[Any]]] | None = None,
) -> dict[str, Any]:
    """A non-streamed response object with one choice per result; tool_calls: text -> (content, calls) for a
    request with tools (server/tools.py)."""
    choices = []
    for i, r in enumerate(results):
        lp = logprobs.format(r.token_ids, r.logprobs or [None] * len(r.token_ids)) if logprobs is not None else None
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": r.text}
            finish = r.finish_reason.value
            if tool_calls is not None:
                content, calls = tool_calls(r.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [c.to_json() for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        else:
            choices.append({"index": i, "text": r.text, "logprobs": lp, "finish_reason": r.finish_reason.value})
    return {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(results),
        "byblock": result_extension(results[0]) if len(results) == 1 else [result_extension(r) for r in results],
    }
