"""What users of vLLM and the OpenAI API reach for, through the real openai client against the real server:
logprobs, n, penalties and vLLM's extra sampling fields, optional model, tool calling (Hermes format), tool messages,
--api-key, /tokenize, /detokenize, /version, and metrics under vLLM's names."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import running
from test_server import MODEL, build_app, client

from byblock import __version__
from byblock.engine.api import generate
from byblock.sampling.params import SamplingParams
from byblock.server.app import ServerConfig, create_app

MSG = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def server():
    target, app = build_app()
    with running(app) as url:
        yield url, target


@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash"])
def test_chat_logprobs_are_the_engines_and_the_same_under_speculation(server, drafter):
    url, target = server
    c = client(url)
    r = c.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"drafter": drafter, "ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    ids = target.encode_messages(MSG)
    ref = generate(target, ids, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3))
    assert len(content) == len(ref.token_ids) == 12
    for entry, lp, tok in zip(content, ref.logprobs, ref.token_ids, strict=True):
        assert abs(entry.logprob - lp.logprob) < 1e-5
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob
        assert entry.token == target.tokenizer.decode([tok], skip_special_tokens=False)
        assert bytes(entry.bytes) == entry.token.encode()
        assert entry.logprob <= 0 and math.isfinite(entry.logprob)


def test_streamed_logprobs_cover_every_token(server):
    url, _ = server
    c = client(url)
    whole = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=10, temperature=0, logprobs=True)
    stream = c.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=10, temperature=0, logprobs=True, stream=True
    )
    streamed = [e for ch in stream for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in whole.choices[0].logprobs.content]


def test_completions_legacy_logprobs(server):
    url, _ = server
    r = client(url).completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(d) <= 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0


def test_n_choices_are_independent_samples_and_seeded(server):
    url, target = server
    c = client(url)
    kw = dict(model=MODEL, messages=MSG, max_tokens=8, temperature=1.0, n=3, seed=11, extra_body={"drafter": "none"})
    r = c.chat.completions.create(**kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in r.choices]
    assert len(set(texts)) > 1  # independent draws
    ids = target.encode_messages(MSG)
    tokens = 0
    for i, text in enumerate(texts):  # choice i is the request with seed + i
        solo = generate(target, ids, SamplingParams(max_new_tokens=8, temperature=1.0, seed=11 + i))
        assert text == solo.text
        tokens += solo.num_new_tokens
    assert r.usage.completion_tokens == tokens and r.usage.prompt_tokens == len(ids)  # the prompt counted once
    again = c.chat.completions.create(**kw)
    assert [ch.message.content for ch in again.choices] == texts
    stream = c.chat.completions.create(**kw, stream=True)
    parts: dict[int, str] = {}
    finishes = {}
    for ch in stream:
        for choice in ch.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [parts[i] for i in range(3)] == texts and set(finishes) == {0, 1, 2}


def test_penalties_and_vllm_sampling_fields_reach_the_engine(server):
    url, target = server
    c = client(url)
    extra = {"repetition_penalty": 1.5, "top_k": 5, "min_p": 0.05, "ignore_eos": True, "drafter": "ngram"}
    kw = dict(model=MODEL, messages=MSG, max_tokens=16, temperature=0, presence_penalty=0.8, frequency_penalty=0.6)
    got = c.chat.completions.create(**kw, extra_body=extra).choices[0].message.content
    ids = target.encode_messages(MSG)
    p = SamplingParams(
        max_new_tokens=16, repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.6, ignore_eos=True
    )
    assert got == generate(target, ids, p).text
    plain = c.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].message.content != got
    free = generate(target, ids, SamplingParams(max_new_tokens=16, ignore_eos=True)).token_ids
    banned = c.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=16,
        temperature=0,
        logit_bias={str(free[0]): -100},
        extra_body={"ignore_eos": True},
        logprobs=True,
    )
    first = banned.choices[0].logprobs.content[0].token
    assert first != target.tokenizer.decode([free[0]], skip_special_tokens=False)
    stopped = c.chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [free[3]]},
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == free.index(free[3]) + 1


def test_model_is_optional_and_max_tokens_defaults_to_the_rest_of_the_context(server):
    url, target = server
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"messages": MSG, "temperature": 0, "ignore_eos": True}, timeout=120
    )
    assert r.status_code == 200
    prompt = r.json()["usage"]["prompt_tokens"]
    # build_app's server sets a default of 64; the rest of the context is the cap when no default is set
    assert r.json()["usage"]["completion_tokens"] == min(64, target.max_context - prompt)


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"u": {"enum": ["c", "f"]}},
            "required": ["u"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def test_named_and_required_tool_choice_return_tool_calls(server):
    """A named tool (or `required`) constrains the turn to one call whose arguments follow the schema."""
    import json

    url, _ = server
    c = client(url)
    named = {"type": "function", "function": {"name": "weather"}}
    r = c.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice=named, max_tokens=120)
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["u"] in ("c", "f")
    r = c.chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name in ("weather", "time")


def test_streamed_tool_call_arrives_as_one_delta(server):
    url, _ = server
    c = client(url)
    named = {"type": "function", "function": {"name": "weather"}}
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=MSG, tools=[WEATHER], tool_choice=named, max_tokens=120, stream=True
        )
    )
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "weather" and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices and ch.choices[0].delta.content for ch in chunks)  # no partial call shown as text


def test_auto_tools_free_text_and_tool_messages_accepted(server):
    """tool_choice auto: the tiny model writes no call, so the turn is text; past calls and results render."""
    url, _ = server
    c = client(url)
    r = c.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER], max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None and r.choices[0].finish_reason in ("length", "stop")
    r = c.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None
    convo = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    assert c.chat.completions.create(model=MODEL, messages=convo, max_tokens=4).choices[0].finish_reason


def test_bad_tools_are_400s(server):
    url, _ = server
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]"):
        c.chat.completions.create(model=MODEL, messages=MSG, tools=[{"type": "function"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        named = {"type": "function", "function": {"name": "nope"}}
        c.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER], tool_choice=named, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="response format"):
        c.chat.completions.create(
            model=MODEL,
            messages=MSG,
            tools=[WEATHER],
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=4,
        )


def test_hermes_parser():
    from byblock.server.tools import parse_calls

    text = 'Let me check.\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>\n<tool_call>{bad}</tool_call>'
    content, calls = parse_calls(text, {"time"})
    assert [c.name for c in calls] == ["time"] and calls[0].arguments == "{}"
    assert content == "Let me check.\n\n<tool_call>{bad}</tool_call>"
    assert parse_calls('<tool_call>{"name": "other", "arguments": {}}</tool_call>', {"time"})[1] == []
    assert parse_calls("plain", {"time"}) == ("plain", [])


def test_tokenize_detokenize_version(server):
    url, target = server
    r = httpx.post(f"{url}/tokenize", json={"prompt": "The quick brown fox"}).json()
    assert r["tokens"] == target.encode_prompt("The quick brown fox", chat=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == target.max_context
    m = httpx.post(f"{url}/tokenize", json={"messages": MSG, "model": MODEL}).json()
    assert m["tokens"] == target.encode_messages(MSG)
    d = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"] == target.tokenizer.decode(r["tokens"])
    assert httpx.get(f"{url}/version").json() == {"version": __version__}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/tokenize", json={}).status_code == 400
    assert httpx.post(f"{url}/tokenize", json={"prompt": "x", "model": "other"}).status_code == 404


def test_api_key_guards_the_api_but_not_health():
    target, _ = build_app()
    from test_server import BatchConfig, BatchedEngineCore

    core = BatchedEngineCore(target, {}, BatchConfig(max_num_seqs=2))
    app = create_app(target, core, ServerConfig(model_name=MODEL, api_key="s3cret", default_max_tokens=4))
    with running(app) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url).chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        ok = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert ok.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices[0].finish_reason
        assert [m.id for m in ok.models.list()] == [MODEL]
        r = httpx.post(f"{url}/tokenize", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


def test_metrics_under_vllm_names(server):
    url, _ = server
    c = client(url)
    c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=12, temperature=0, extra_body={"drafter": "ngram"})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:num_preemptions",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    ):
        assert name in fams, name
        assert all(s.labels.get("model_name") == MODEL for s in fams[name].samples), name
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    total = lambda n: sum(v for (k, _), v in value.items() if k == n)  # noqa: E731
    assert total("vllm:generation_tokens_total") >= 12
    assert total("vllm:spec_decode_num_draft_tokens_total") >= total("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = total("vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == total("vllm:spec_decode_num_accepted_tokens_total")
    assert total("vllm:request_success_total") >= 1
    assert "byblock_tau" in fams  # byblock's own series stay beside vLLM's
