"""Tool calling on /v1/chat/completions: OpenAI's `tools` / `tool_choice`, in the Hermes format vLLM's
`hermes` parser reads.

The built-in models' chat templates know no tools, so byblock states them itself: a system turn lists the
functions' JSON signatures inside <tools></tools> and asks for calls as <tool_call>{"name": ..., "arguments":
{...}}</tool_call> (the convention of Hermes / Qwen templates). Past calls and tool results go back into the
conversation in the same tags. What the model writes is parsed by `parse_calls`:

    tool_choice "auto" (default)   free text; every well-formed <tool_call> block becomes a tool call
    tool_choice "required"         the output is constrained (llguidance JSON schema) to one call of a listed tool
    {"type": "function", ...}      ... to one call of that tool (vLLM: guided decoding of its parameters)
    tool_choice "none"             no tools offered, the turn is plain text

A response with calls has `message.tool_calls` and finish_reason "tool_calls" (vLLM's and OpenAI's shape).
Streamed requests with tools send their text once decided (one content delta, one tool_calls delta), not token by
token: a partial tag is never shown as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from byblock.sampling.grammar import Grammar
from byblock.server.protocol import ApiError

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: str  # a JSON object, as OpenAI sends it (a string)
    id: str

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's tool_calls entry (streamed deltas carry an index)."""
        fn = {"name": self.name, "arguments": self.arguments}
        out: dict[str, Any] = {"id": self.id, "type": "function", "function": fn}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, validated: the functions offered and how the turn must use them."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description", "parameters"}
    choice: str  # "auto" | "required" | "named"
    named: str | None = None

    @staticmethod
    def parse(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> ToolUse | None:
        """None when no tools are offered (absent, empty, or tool_choice "none"); a 400 for malformed ones."""
        if not tools or tool_choice == "none":
            return None
        functions = []
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
                raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
                raise ApiError(400, f"tools[{i}].function.name must be 1-64 letters, digits, _ or -", "tools")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            functions.append({"name": name, "description": str(fn.get("description", "")), "parameters": params})
        names = [f["name"] for f in functions]
        if tool_choice in (None, "auto"):
            return ToolUse(tuple(functions), "auto")
        if tool_choice == "required":
            return ToolUse(tuple(functions), "required")
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            name = (tool_choice.get("function") or {}).get("name")
            if name not in names:
                raise ApiError(400, f"tool_choice names '{name}', which is not in tools", "tool_choice")
            return ToolUse(tuple(functions), "named", name)
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")

    def system_turn(self) -> str:
        """The system text that states the tools and the call format (kept short: it costs prompt tokens)."""
        sigs = "\n".join(json.dumps({"type": "function", "function": f}, separators=(",", ":")) for f in self.functions)
        return (
            f"You may call these tools:\n<tools>\n{sigs}\n</tools>\nTo call one, answer with "
            '<tool_call>{"name": <tool-name>, "arguments": <args-json-object>}</tool_call>'
        )

    def grammar(self) -> Grammar | None:
        """The constraint for "required" / named: exactly one call's JSON object (the tags are implied)."""
        if self.choice == "auto":
            return None
        offered = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        options = [
            {
                "type": "object",
                "properties": {"name": {"enum": [f["name"]]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in offered
        ]
        return Grammar.json_schema(options[0] if len(options) == 1 else {"anyOf": options})

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the message content, the tool calls) of the model's text for this turn."""
        if self.choice != "auto":  # constrained: the whole text is one call's JSON object
            call = _call(text)
            return (None, [call]) if call is not None else (text, [])
        return parse_calls(text, {f["name"] for f in self.functions})


def _call(body: str, names: set[str] | None = None) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args), f"call_{uuid.uuid4().hex[:24]}")


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style parsing: every <tool_call>{...}</tool_call> block naming an offered tool with a JSON object
    is a call and leaves the content; malformed blocks stay in the content, as text."""
    calls, kept, at = [], [], 0
    for m in CALL.finditer(text):
        call = _call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[at : m.start()])
        at = m.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None, calls) if calls else (text, [])


def conversation(messages: list[dict[str, Any]], use: ToolUse | None) -> list[dict[str, str]]:
    """The chat template's role/content turns: the tools' system turn first (merged into a system message the
    request has), past calls as <tool_call> blocks, tool results as <tool_response> user turns."""
    turns: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [_call_block(c) for c in m["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        turns.append({"role": role, "content": content})
    if use is not None:
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": turns[0]["content"] + "\n\n" + use.system_turn()}
        else:
            turns.insert(0, {"role": "system", "content": use.system_turn()})
    return turns


def _call_block(call: Any) -> str:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        parsed = args
    return "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": parsed}) + "\n</tool_call>"
