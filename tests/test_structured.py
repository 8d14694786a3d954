"""Structured output (llguidance token masks): every output obeys its grammar, speculative and batched decoding
are lossless w.r.t. the constrained distribution, and the server answers the openai client's `parse` helper."""

from __future__ import annotations

import functools
import json
from typing import Literal

import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lossless import NoisyOracleDrafter, greedy_outputs_match
from pydantic import BaseModel, Field
from serving import running
from stats import chi_square_pvalue
from test_server import MODEL, build_app, client
from tiny import ARCHS, make_target

from byblock import SamplingParams, generate
from byblock.drafters import ModelDrafter, NgramConfig, NgramDrafter
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.types import SpecStats
from byblock.errors import InvalidParameterError
from byblock.sampling.grammar import Grammar, GrammarKind
from byblock.sampling.processors import process_logits

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "c": {"enum": ["red", "green"]},
    },
    "required": ["n", "ok", "c"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 33, 9]


@functools.cache
def target(arch: str):
    return make_target(arch, packed=True)


def schema_ok(text: str) -> bool:
    obj = json.loads(text)
    return (
        set(obj) == {"n", "ok", "c"}
        and 0 <= obj["n"] <= 99
        and isinstance(obj["ok"], bool)
        and obj["c"] in ("red", "green")
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_constrained_greedy_output_obeys_the_schema_and_differs_from_free(arch):
    t = target(arch)
    p = SamplingParams(max_new_tokens=60, grammar=Grammar.json_schema(SCHEMA))
    r = generate(t, PROMPT, p)
    assert r.finish_reason == "stop" and schema_ok(r.text)
    assert generate(t, PROMPT, SamplingParams(max_new_tokens=60)).text != r.text


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    arch=st.sampled_from(ARCHS),
    prompt=st.lists(st.integers(3, 319), min_size=1, max_size=12),
    block_size=st.integers(1, 10),
    kind=st.sampled_from(["oracle-chain", "oracle-tree", "ngram-tree", "ngram-chain"]),
    which=st.sampled_from(["schema", "regex", "choice"]),
    seed=st.integers(0, 10**6),
)
def test_greedy_speculative_under_a_grammar_equals_plain(arch, prompt, block_size, kind, which, seed):
    t = target(arch)
    grammar = {
        "schema": Grammar.json_schema(SCHEMA),
        "regex": Grammar(GrammarKind.REGEX, "(ab|a[0-9]+|The )+"),
        "choice": Grammar(GrammarKind.CHOICE, json.dumps(["The quick brown fox", "def add(a, b)"])),
    }[which]
    p = SamplingParams(max_new_tokens=40, grammar=grammar, logprobs=1)
    ref = prompt + generate(t, prompt, p).token_ids  # the oracle follows the constrained continuation
    if kind.startswith("oracle"):
        drafter = NoisyOracleDrafter(ref, block_size, tree=kind == "oracle-tree", vocab=t.vocab_size, seed=seed)
    else:
        cands = 1 if kind == "ngram-chain" else 3
        drafter = NgramDrafter(NgramConfig(block_size=block_size, num_candidates=cands, tree_budget=16, min_n=1))
    greedy_outputs_match(t, prompt, p, drafter)


def test_batched_engine_with_grammars_matches_solo():
    t = target("llama")
    prompts = [PROMPT, [40, 41, 42], [7, 7, 7, 8]]
    params = [
        SamplingParams(max_new_tokens=50, grammar=Grammar.json_schema(SCHEMA)),
        SamplingParams(max_new_tokens=20, grammar=Grammar(GrammarKind.REGEX, "(ab|a[0-9]+)+"), temperature=0.9, seed=2),
        SamplingParams(max_new_tokens=30),
    ]
    drafter = NgramDrafter(NgramConfig(block_size=4, num_candidates=3, tree_budget=12, min_n=1))
    for got, prompt, p in zip(generate(t, prompts, params, drafter=drafter), prompts, params, strict=True):
        assert got.token_ids == generate(t, prompt, p, drafter=drafter.fork()).token_ids
    assert schema_ok(generate(t, prompts, params)[0].text)


def test_speculative_sampling_under_a_grammar_matches_the_constrained_law():
    t = target("llama")
    grammar = Grammar(GrammarKind.REGEX, "(a|b|c|ab|abc)[0-9]")
    p = SamplingParams(temperature=1.0, max_new_tokens=4, grammar=grammar)

    import llguidance.hf

    tok = llguidance.hf.from_tokenizer(t.tokenizer, n_vocab=t.vocab_size, eos_token=sorted(t.eos_token_ids))

    def mask(prefix: list[int]) -> torch.Tensor:  # an independent matcher replayed over the prefix
        m = llguidance.LLMatcher(tok, grammar.llguidance_grammar())
        assert m.consume_tokens(prefix)
        allowed = torch.zeros(t.vocab_size, dtype=torch.bool)
        for i in range(t.vocab_size):
            allowed[i] = m.validate_tokens([i]) == 1
        return allowed

    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        if len(prefix) == 2:
            exact[tuple(prefix)] = prob
            return
        logits = t.forward(torch.tensor([PROMPT + prefix]), t.new_cache()).logits[0, -1]
        q = process_logits(logits.masked_fill(~mask(prefix), float("-inf")), p)
        for tok_id in torch.nonzero(q).flatten().tolist():
            expand([*prefix, tok_id], prob * float(q[tok_id]))

    expand([], 1.0)
    assert len(exact) > 3
    drafter = ModelDrafter(make_target("llama", seed=1), target_vocab=t.vocab_size, block_size=3)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(1200):
        loop = speculative_decode(t, drafter, PROMPT, p, g, SpecStats())
        samples.append(tuple(next(loop).token_id for _ in range(2)))
        loop.close()
    assert chi_square_pvalue(samples, exact) > 1e-3


def test_bad_grammars_are_one_line_errors():
    with pytest.raises(InvalidParameterError, match="not valid JSON"):
        Grammar(GrammarKind.JSON_SCHEMA, "{nope")
    with pytest.raises(InvalidParameterError, match="invalid"):
        Grammar.json_schema({"type": "nonsense"}).check()
    with pytest.raises(InvalidParameterError, match="list of strings"):
        Grammar(GrammarKind.CHOICE, "[]")
    with pytest.raises(InvalidParameterError):
        Grammar(GrammarKind.REGEX, "(unclosed").check()


# ---- through the server ------------------------------------------------------------------------------------


class Answer(BaseModel):
    n: int = Field(ge=0, le=99)
    ok: bool
    c: Literal["red", "green"]


@pytest.fixture(scope="module")
def server():
    target_model, app = build_app()
    with running(app) as url:
        yield url, target_model


@pytest.mark.parametrize("drafter", ["none", "ngram", "dflash"])
def test_openai_parse_helper_gets_a_parsed_object(server, drafter):
    url, _ = server
    r = client(url).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "The quick brown fox"}],
        response_format=Answer,
        max_tokens=60,
        temperature=0,
        extra_body={"drafter": drafter},
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer)
    assert Answer.model_validate_json(r.choices[0].message.content) == parsed


def test_json_object_regex_and_choice_through_the_server(server):
    url, _ = server
    c = client(url)
    msgs = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = c.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = c.completions.create(
        model=MODEL, prompt="x", max_tokens=10, temperature=0, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        {"structured_outputs": {"regex": "(a"}},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_bad_structured_requests_are_400(server, extra):
    url, _ = server
    with pytest.raises(openai.BadRequestError):
        client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=extra
        )
