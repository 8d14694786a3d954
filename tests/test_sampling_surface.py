"""The OpenAI sampling surface: penalties, logit bias, min-p, stop token ids and logprobs — each lossless under
speculative decoding (greedy: token-identical; sampling: the exact law), batched and alone, and each checked
against an independent reference computed from full forwards."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lossless import NoisyOracleDrafter, greedy_outputs_match
from stats import chi_square_pvalue
from tiny import ARCHS, make_target

from byblock import SamplingParams, generate
from byblock.drafters import ModelDrafter, NgramConfig, NgramDrafter
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.types import SpecStats
from byblock.errors import InvalidParameterError
from byblock.sampling.penalties import Penalties
from byblock.sampling.processors import process_logits
from byblock.verify.rows import AdjustedRows

PENALTIES = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.5, logit_bias={7: 2.5, 9: -3.0})


@functools.cache
def target(arch: str, packed: bool = True):
    return make_target(arch, packed=packed)


def reference_row(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties written out token by token (the definition Penalties.row must equal)."""
    x = logits.float().clone()
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    return x


def reference_greedy(t, prompt: list[int], p: SamplingParams) -> list[int]:
    """Penalized greedy decoding from full forwards (no cache, no byblock selector)."""
    out: list[int] = []
    for _ in range(p.max_new_tokens):
        logits = t.forward(torch.tensor([prompt + out]), t.new_cache()).logits[0, -1]
        out.append(int(reference_row(logits, prompt, out, p).argmax()))
    return out


def test_penalties_row_equals_the_definition():
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(**PENALTIES)
    prompt, out, extra = [1, 2, 3, 3], [3, 4, 4, 5], [5, 6]
    pen = Penalties(p, prompt, 16, torch.device("cpu"))
    pen.append(out)
    logits = torch.randn(16, generator=g) * 3
    assert torch.allclose(pen.row(logits, extra), reference_row(logits, prompt, out + extra, p))
    assert torch.allclose(pen.row(logits), reference_row(logits, prompt, out, p))


def test_penalized_rows_use_each_nodes_own_path():
    p = SamplingParams(frequency_penalty=1.0)
    pen = Penalties(p, [], 8, torch.device("cpu"))
    rows = torch.zeros(4, 8)
    tokens, parents = [3, 4, 5], [-1, 0, -1]  # root ─ 3 ─ 4, root ─ 5
    adj = AdjustedRows(rows, pen.row, tokens, parents)
    assert adj[0].tolist() == [0.0] * 8
    assert adj[2][3] == -1 and adj[2][4] == -1 and adj[2][5] == 0  # node 1's path: 3, 4
    assert adj[3][5] == -1 and adj[3][3] == 0  # node 2's path: 5


def test_min_p_keeps_tokens_above_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.25))
    assert probs[3] == 0 and probs[2] > 0  # 0.05 < 0.25 * 0.5 <= 0.15
    assert torch.allclose(probs.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_penalties_equal_the_reference_and_change_the_output(arch):
    t = target(arch)
    prompt = [5, 17, 33, 9, 5, 17]
    p = SamplingParams(max_new_tokens=12, ignore_eos=True, **PENALTIES)
    got = generate(t, prompt, p).token_ids
    assert got == reference_greedy(t, prompt, p)
    assert got != generate(t, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    arch=st.sampled_from(ARCHS),
    prompt=st.lists(st.integers(3, 319), min_size=1, max_size=16),
    block_size=st.integers(1, 10),
    max_new=st.integers(1, 24),
    kind=st.sampled_from(["oracle-chain", "oracle-tree", "ngram-tree"]),
    rep=st.sampled_from([1.0, 1.3, 0.8]),
    presence=st.sampled_from([0.0, 0.7, -0.5]),
    freq=st.sampled_from([0.0, 0.4, 1.5]),
    seed=st.integers(0, 10**6),
)
def test_greedy_speculative_with_penalties_equals_plain(
    arch, prompt, block_size, max_new, kind, rep, presence, freq, seed
):
    t = target(arch)
    p = SamplingParams(
        max_new_tokens=max_new, repetition_penalty=rep, presence_penalty=presence, frequency_penalty=freq, logprobs=2
    )
    # The oracle follows the *penalized* continuation, so long paths get accepted and the per-node paths matter.
    ref = prompt + generate(t, prompt, SamplingParams(max_new_tokens=32, ignore_eos=True, **_pen(p))).token_ids
    if kind.startswith("oracle"):
        drafter = NoisyOracleDrafter(ref, block_size, tree=kind == "oracle-tree", vocab=t.vocab_size, seed=seed)
    else:
        drafter = NgramDrafter(NgramConfig(block_size=block_size, num_candidates=3, tree_budget=24))
    plain, spec = greedy_outputs_match(t, prompt, p, drafter)
    _same_logprobs(plain, spec)


def _pen(p: SamplingParams) -> dict:
    return dict(
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )


def _same_logprobs(a, b) -> None:
    """The same token logprobs and top alternatives, to float32 rounding (a k-row verify's attention sums in
    another order than a 1-row step's; the tokens are identical, the logits equal to ~1e-7)."""
    assert a.logprobs is not None and b.logprobs is not None
    assert len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert abs(x.logprob - y.logprob) < 1e-5
        assert [i for i, _ in x.top] == [i for i, _ in y.top]
        assert all(abs(u - v) < 1e-5 for (_, u), (_, v) in zip(x.top, y.top, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_are_the_raw_rows_and_speculation_returns_the_same(arch):
    t = target(arch)
    prompt = [5, 17, 33, 9, 5, 17]
    p = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3)
    plain = generate(t, prompt, p)
    ids = plain.token_ids
    for j, lp in enumerate(plain.logprobs):  # against a full forward's log_softmax at each position
        row = torch.log_softmax(t.forward(torch.tensor([prompt + ids[:j]]), t.new_cache()).logits[0, -1], -1)
        assert abs(lp.logprob - float(row[ids[j]])) < 1e-4
        assert [i for i, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    ref = prompt + ids
    for tree in (False, True):
        spec = generate(t, prompt, p, drafter=NoisyOracleDrafter(ref, 4, tree=tree, vocab=t.vocab_size, seed=1))
        assert spec.token_ids == ids and sum(spec.from_draft) > 0
        _same_logprobs(plain, spec)
    assert generate(t, prompt, SamplingParams(max_new_tokens=3)).logprobs is None


def test_batched_engine_matches_solo_with_penalties_and_logprobs():
    t = target("llama")
    prompts = [[5, 17, 33, 9, 5, 17], [40, 41, 42], [7, 7, 7, 7, 8]]
    params = [
        SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=1, **PENALTIES),
        SamplingParams(max_new_tokens=9, temperature=0.8, top_k=5, min_p=0.05, seed=3, presence_penalty=1.0),
        SamplingParams(max_new_tokens=11, ignore_eos=True, repetition_penalty=1.6, logprobs=0),
    ]
    drafter = NgramDrafter(NgramConfig(block_size=4, num_candidates=3, tree_budget=12, min_n=1))
    batched = generate(t, prompts, params, drafter=drafter)
    for prompt, p, got in zip(prompts, params, batched, strict=True):
        solo = generate(t, prompt, p, drafter=drafter.fork())
        assert got.token_ids == solo.token_ids
        if p.logprobs is not None:
            _same_logprobs(got, solo)


def test_stop_token_ids_end_the_request_even_with_ignore_eos():
    t = target("llama")
    prompt = [5, 17, 33, 9]
    free = generate(t, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    stop_id = free[4]
    first = free.index(stop_id)
    r = generate(t, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)))
    assert r.token_ids == free[: first + 1]
    assert r.finish_reason == "stop"
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        generate(t, prompt, SamplingParams(stop_token_ids=(10**6,)))


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_p=1.5),
        dict(repetition_penalty=0.0),
        dict(presence_penalty=3.0),
        dict(frequency_penalty=float("nan")),
        dict(logit_bias={"x": 1.0}),
        dict(logit_bias={5: 500.0}),
        dict(logprobs=21),
        dict(stop_token_ids=(-1,)),
    ],
)
def test_bad_sampling_values_are_refused(bad):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**bad)


# ---- sampling: the exact law with penalties ------------------------------------------------------------


def exact_penalized(t, prompt: list[int], p: SamplingParams, length: int) -> dict[tuple[int, ...], float]:
    """The exact law of the first `length` tokens of penalized plain sampling (top-k keeps it enumerable)."""
    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        if len(prefix) == length:
            exact[tuple(prefix)] = prob
            return
        logits = t.forward(torch.tensor([prompt + prefix]), t.new_cache()).logits[0, -1]
        q = process_logits(reference_row(logits, prompt, prefix, p), p)
        for tok in torch.nonzero(q).flatten().tolist():
            expand([*prefix, tok], prob * float(q[tok]))

    expand([], 1.0)
    return exact


@pytest.mark.parametrize("kind", ["model", "ngram-tree"])
def test_speculative_sampling_with_penalties_matches_the_exact_law(kind):
    t = make_target("llama")
    prompt = [5, 17, 33, 9, 5, 17]
    p = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4, repetition_penalty=1.5, frequency_penalty=1.0)
    if kind == "model":
        drafter = ModelDrafter(make_target("llama", seed=1), target_vocab=t.vocab_size, block_size=3)
    else:
        drafter = NgramDrafter(NgramConfig(block_size=3, num_candidates=3, min_n=1))
    exact = exact_penalized(t, prompt, p, 3)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(1500):
        loop = speculative_decode(t, drafter, prompt, p, g, SpecStats())
        samples.append(tuple(next(loop).token_id for _ in range(3)))
        loop.close()
    assert chi_square_pvalue(samples, exact) > 1e-3
    # Power: the unpenalized law is told apart from the penalized one at this sample size.
    plain_law = exact_penalized(t, prompt, SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4), 3)
    assert chi_square_pvalue(samples, plain_law) < 1e-3
