"""`byblock serve`: the real openai client against the real server on a free loopback port.

Tiny random llama target; drafters ngram and a random DFlash — block drafting must never change the text.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import running
from tiny import make_dflash, make_target

from byblock.drafters.dflash import DFlashDrafter
from byblock.drafters.ngram import NgramConfig, NgramDrafter
from byblock.engine.api import generate
from byblock.engine.batched import BatchedEngineCore
from byblock.engine.core import SerialEngineCore
from byblock.engine.scheduler import BatchConfig
from byblock.sampling.params import SamplingParams
from byblock.server.app import ServerConfig, create_app

MODEL = "tiny-llama"


def build_app(
    max_tokens_limit: int = 4096,
    chat_template: str | None = None,
    engine: str = "batched",
    max_num_seqs: int = 8,
    max_pending: int | None = None,
):
    """A fresh app over a tiny llama (fp32, packed GEMM, as load_model sets it up) with ngram and dflash drafters,
    behind the batched engine (the server's default) or the FIFO one; optionally another chat template."""
    target = make_target("llama", packed=True)
    if chat_template is not None:
        target.tokenizer.chat_template = chat_template
    drafters = {
        "ngram": NgramDrafter(NgramConfig(block_size=4)),
        "dflash": DFlashDrafter(make_dflash(target, block=4), target),
    }
    if engine == "batched":
        core = BatchedEngineCore(target, drafters, BatchConfig(max_num_seqs=max_num_seqs))
    else:
        core = SerialEngineCore(target, drafters)
    cfg = ServerConfig(
        model_name=MODEL,
        default_drafter="ngram",
        default_max_tokens=64,
        max_tokens_limit=max_tokens_limit,
        max_pending=max_pending,
    )
    return target, create_app(target, core, cfg)


@pytest.fixture(scope="module")
def server():
    """(base_url, target) of a running server."""
    target, app = build_app()
    with running(app) as url:
        yield url, target


def client(url: str) -> openai.OpenAI:
    """The real OpenAI client pointed at the server."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def metric_values(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def chat(c: openai.OpenAI, prompt: str, drafter: str, **kw):
    """A chat completion with byblock's drafter field."""
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], extra_body={"drafter": drafter}, **kw
    )


def streamed_text(stream) -> tuple[str, list[dict], list[int]]:
    """(text, chunks as dicts, from_draft flags) of a streamed chat completion."""
    text, chunks, flags = "", [], []
    for chunk in stream:
        d = chunk.model_dump()
        chunks.append(d)
        if d["choices"] and d["choices"][0]["delta"].get("content"):
            text += d["choices"][0]["delta"]["content"]
            flags += (d.get("byblock") or {}).get("from_draft", [])
    return text, chunks, flags


def test_models_and_health(server):
    url, _ = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_dump()["byblock"]["drafters"] == ["none", "ngram", "dflash"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash"])
def test_chat_greedy_equals_engine_and_stream_equals_whole(server, drafter):
    url, target = server
    c = client(url)
    prompt = "The quick brown fox"
    whole = chat(c, prompt, drafter, max_tokens=40, temperature=0)
    ref = generate(target, prompt, SamplingParams(max_new_tokens=40))  # plain decoding, engine API, no server
    assert whole.choices[0].message.content == ref.text
    assert whole.usage.completion_tokens == ref.num_new_tokens
    assert whole.usage.prompt_tokens == ref.prompt_tokens
    assert whole.usage.total_tokens == ref.prompt_tokens + ref.num_new_tokens
    assert whole.choices[0].finish_reason == ref.finish_reason.value
    text, chunks, flags = streamed_text(
        chat(c, prompt, drafter, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert text == ref.text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == ref.finish_reason.value
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == ref.num_new_tokens
    assert len(flags) == ref.num_new_tokens - (ref.finish_reason.value == "stop")  # EOS is not sent as text
    ext = chunks[-2]["byblock"]
    assert ext["drafter"] == drafter and len(ext["from_draft"]) == ref.num_new_tokens
    if drafter == "none":
        assert sum(ext["from_draft"]) == 0 and ext["tau"] == 1.0


def test_completions_endpoint_text_and_token_prompts(server):
    url, target = server
    c = client(url)
    ids = target.encode_prompt("def add(a, b):", chat=False)
    ref = generate(target, ids, SamplingParams(max_new_tokens=24))
    by_text = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=24, temperature=0)
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == ref.text
    default = c.completions.create(model=MODEL, prompt="def add(a, b):", temperature=0)
    assert default.usage.completion_tokens <= 16  # OpenAI's default max_tokens for completions
    parts = [
        ch.choices[0].text
        for ch in c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=24, temperature=0, stream=True)
    ]
    assert "".join(parts) == ref.text


def test_stop_strings_and_seeded_sampling(server):
    url, _ = server
    c = client(url)
    a = chat(c, "Write a haiku", "dflash", max_tokens=30, temperature=1.0, top_p=0.9, seed=7)
    b = chat(c, "Write a haiku", "none", max_tokens=30, temperature=1.0, top_p=0.9, seed=7)
    again = chat(c, "Write a haiku", "dflash", max_tokens=30, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].message.content == again.choices[0].message.content  # same seed, same drafter: same text
    assert b.choices[0].message.content  # sampled text exists (equality across drafters is distributional)
    text = a.choices[0].message.content
    if len(text) > 4:
        stop = text[2:4]
        cut = chat(c, "Write a haiku", "dflash", max_tokens=30, temperature=1.0, top_p=0.9, seed=7, stop=[stop])
        assert cut.choices[0].message.content == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def fifo_server():
    """(base_url, target) of a server on the FIFO engine (`--engine fifo`)."""
    target, app = build_app(engine="fifo")
    with running(app) as url:
        yield url, target


@pytest.mark.parametrize("which", ["server", "fifo_server"])
def test_concurrent_clients_get_their_solo_outputs(which, request):
    """12 concurrent clients (greedy and seeded, streamed or not, three drafters) each get their solo text:
    batched into shared forwards, or one at a time."""
    url, _ = request.getfixturevalue(which)
    jobs = [
        ("The quick brown fox", "ngram", 0.0, None, False),
        ("def add(a, b):", "dflash", 1.0, 11, True),
        ("Question: what is 12 plus 30?", "none", 1.0, 12, False),
        ("for i in range(10):", "dflash", 0.0, None, True),
        ("Write a haiku about GPUs.", "ngram", 0.8, 13, True),
        ("The quick brown fox", "none", 1.0, 14, False),
    ]

    def one(job):
        prompt, drafter, temp, seed, stream = job
        c = client(url)
        kw = dict(max_tokens=32, temperature=temp, seed=seed)
        if stream:
            return streamed_text(chat(c, prompt, drafter, stream=True, **kw))[0]
        return chat(c, prompt, drafter, **kw).choices[0].message.content

    alone = [one(j) for j in jobs]
    with cf.ThreadPoolExecutor(len(jobs) * 2) as pool:
        together = list(pool.map(one, jobs + jobs))
    assert together == alone + alone


ERRORS = [
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ({"model": MODEL, "messages": []}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 3}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999": 1}}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [99999]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, None),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21, "logprobs": True},
        400,
        None,
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_p": 2}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, None),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
        400,
        None,
    ),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "drafter": "eagle9"}, 400, None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}]}, 400, "context_length_exceeded"),
    ({"model": MODEL, "messages": "hi"}, 400, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, None),
]


@pytest.mark.parametrize(("body", "status", "code"), ERRORS)
def test_bad_requests_get_openai_error_bodies(server, body, status, code):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and err["type"] == "invalid_request_error"
    if code:
        assert err["code"] == code


def test_malformed_json_and_unknown_routes(server):
    url, target = server
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [target.vocab_size + 5]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{url}/health").status_code == 200  # still up


def test_client_disconnect_stops_generation(server):
    url, _ = server
    before = metric_values(url)
    body = {
        "model": MODEL,
        "prompt": "The quick",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "drafter": "none",
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk in, hang up
    deadline = time.time() + 20
    while time.time() < deadline:
        m = metric_values(url)
        if m.get(("byblock_requests_aborted_total", ()), 0) > before.get(("byblock_requests_aborted_total", ()), 0):
            break
        time.sleep(0.05)
    assert m[("byblock_requests_aborted_total", ())] == before.get(("byblock_requests_aborted_total", ()), 0) + 1
    assert m[("byblock_running_requests", ())] == 0
    gen = m.get(("byblock_generation_tokens_total", (("drafter", "none"),)), 0)
    assert gen == before.get(("byblock_generation_tokens_total", (("drafter", "none"),)), 0)  # aborted: not counted
    ok = client(url).completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
    assert ok.choices[0].text is not None


def test_metrics_parse_and_count(server):
    url, _ = server
    before = metric_values(url)
    c = client(url)
    for drafter in ("ngram", "dflash"):
        chat(c, "The quick brown fox", drafter, max_tokens=20, temperature=0)
    m = metric_values(url)
    key = ("byblock_requests_total", (("endpoint", "chat"), ("status", "ok")))
    assert m[key] == before.get(key, 0) + 2
    for drafter in ("ngram", "dflash"):
        assert m[("byblock_spec_rounds_total", (("drafter", drafter),))] > 0
        tau = m[("byblock_tau", (("drafter", drafter),))]
        assert 1.0 <= tau <= 5.0
        assert 0.0 <= m[("byblock_acceptance_rate", (("drafter", drafter),))] <= 1.0
        assert m[("byblock_time_to_first_token_seconds_count", (("drafter", drafter),))] >= 1
        assert m[("byblock_time_per_output_token_seconds_count", (("drafter", drafter),))] >= 1
    assert m[("byblock_queue_depth", ())] == 0
    assert m[("process_resident_memory_bytes", ())] > 10e6


def test_request_log_is_one_json_line_per_request(server, caplog):
    url, _ = server
    with caplog.at_level("INFO", logger="byblock.server"):
        chat(client(url), "hi", "ngram", max_tokens=5, temperature=0)
        httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "byblock.server"]
    assert [ln["event"] for ln in lines] == ["request", "rejected"]
    assert lines[0]["status"] == "ok" and lines[0]["completion_tokens"] >= 1 and lines[0]["drafter"] == "ngram"
    assert lines[1]["status"] == 404


@pytest.mark.parametrize("extreme", [{"temperature": 5e-324}, {"temperature": 1.0, "top_p": 1e-300}])
def test_extreme_sampling_values_decode_greedily(server, extreme):
    url, _ = server
    c = client(url)
    greedy = c.completions.create(model=MODEL, prompt="def add", max_tokens=8, temperature=0)
    edge = c.completions.create(model=MODEL, prompt="def add", max_tokens=8, seed=3, **extreme)
    assert edge.choices[0].text == greedy.choices[0].text


def test_a_full_server_answers_503_with_retry_after():
    """Past max_pending requests in the engine a request gets a 503 with Retry-After; a slot frees when one ends."""
    _, app = build_app(max_num_seqs=1, max_pending=2)
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 200, "temperature": 0, "drafter": "none"}
    with running(app) as url:
        with cf.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=120), range(6)))
        codes = sorted(r.status_code for r in replies)
        assert codes.count(200) >= 2 and 503 in codes, codes
        full = next(r for r in replies if r.status_code == 503)
        assert full.headers["Retry-After"] == "1"
        assert full.json()["error"]["code"] == "overloaded" and "capacity" in full.json()["error"]["message"]
        c = client(url)
        with pytest.raises(openai.InternalServerError), cf.ThreadPoolExecutor(4) as pool:  # a 5xx to the client
            list(pool.map(lambda _: c.completions.create(model=MODEL, prompt="The quick", max_tokens=200), range(4)))
        ok = client(url).completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0)
        assert ok.choices[0].text is not None


def test_batch_metrics(server):
    """The batched engine's gauges: batch size and rows of the last forward, KV slots held, preemptions."""
    url, _ = server
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: chat(client(url), p, "dflash", max_tokens=24, temperature=0), ["a", "b", "c", "d"]))
    m = metric_values(url)
    assert m[("byblock_batch_size", ())] >= 1 and m[("byblock_batch_rows", ())] >= 1
    assert m[("byblock_kv_cache_tokens", ())] == 0  # every request finished: every cache freed
    assert m[("byblock_preemptions", ())] == 0 and m[("byblock_kv_cache_usage", ())] == 0
