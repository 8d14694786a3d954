"""The batched diffusion engine: requests joining and leaving at any step, each exactly its solo run.

Tiny random mask models (llama, qwen3) prepared with byblock's packed fp32 GEMM, every mask sampler, greedy
and sampled, random prompt lengths, arrival steps, aborts and batch limits (hypothesis). The reference is
`diffusion_generate` on the same model, alone.
"""

from __future__ import annotations

import pytest
import torch
from engines import drive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import make_hf_model, make_tokenizer

from byblock.dllm import DllmConfig, SamplerKind
from byblock.dllm.config import CacheMode
from byblock.dllm.denoisers import MaskDenoiser
from byblock.dllm.generate import diffusion_generate
from byblock.engine.core import EngineRequest
from byblock.engine.dllm_batched import DllmBatchedEngineCore, batchable, prepare_for_batching
from byblock.engine.scheduler import BatchConfig
from byblock.errors import InvalidParameterError
from byblock.sampling.params import SamplingParams

SAMPLERS = [s for s in SamplerKind if s is not SamplerKind.RENOISE]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    hf = make_hf_model(request.param)
    den = MaskDenoiser(hf, mask_token_id=hf.config.vocab_size - 1, block_size=4)
    prepare_for_batching(den)
    tok = make_tokenizer(320)
    return den, tok


request_st = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 30),
        "seed": st.integers(0, 2**16),
        "max_new": st.integers(1, 14),
        "sampled": st.booleans(),
        "arrive": st.integers(0, 8),
        "abort": st.one_of(st.none(), st.integers(0, 12)),
    }
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=5),
    sampler=st.sampled_from(SAMPLERS),
    max_seqs=st.integers(1, 4),
    budget=st.integers(4, 64),
)
def test_random_mix_matches_solo(model, reqs, sampler, max_seqs, budget):
    den, tok = model
    base = DllmConfig(sampler=sampler, threshold=0.5)
    core = DllmBatchedEngineCore(den, tok, frozenset(), base, BatchConfig(max_seqs, budget, chunked_prefill=False))
    arrivals, aborts, expected = {}, {}, {}
    for i, r in enumerate(reqs):
        g = torch.Generator().manual_seed(r["seed"])
        ids = torch.randint(3, 300, (r["prompt_len"],), generator=g).tolist()
        params = SamplingParams(max_new_tokens=r["max_new"], temperature=0.7 if r["sampled"] else 0.0, seed=r["seed"])
        rid = f"r{i}"
        arrivals.setdefault(r["arrive"], []).append(EngineRequest(rid, tuple(ids), params))
        if r["abort"] is not None:
            aborts.setdefault(r["arrive"] + r["abort"], []).append(rid)
        cfg = DllmConfig(sampler=sampler, threshold=0.5, max_new_tokens=r["max_new"], temperature=params.temperature)
        expected[rid] = (ids, DllmConfig(**{**cfg.__dict__, "seed": r["seed"]}))
    results, texts, _ = drive(core, arrivals, aborts)
    for rid, (ids, cfg) in expected.items():
        if rid not in results:  # aborted
            continue
        solo = diffusion_generate(den, ids, cfg)
        assert results[rid].token_ids == solo.token_ids, (rid, cfg)
        assert results[rid].stats.rounds == solo.nfe
        assert texts.get(rid, "") == results[rid].text
    assert not core.has_unfinished()


def test_requests_share_forwards_and_stop_like_the_fifo_engine(model):
    """Several requests really run together; EOS and stop strings end them as the FIFO engine does."""
    from byblock.engine.dllm_core import DllmEngineCore

    den, tok = model
    base = DllmConfig(sampler=SamplerKind.THRESHOLD, threshold=0.5)
    eos = frozenset({7})
    reqs = [
        EngineRequest(f"q{i}", tuple(range(3 + i, 9 + 2 * i)), SamplingParams(max_new_tokens=16, seed=i, stop=stop))
        for i, stop in enumerate([(), ("a",), (), ("e", "o")])
    ]
    batched = DllmBatchedEngineCore(den, tok, eos, base)
    got, texts, widest = drive(batched, {0: reqs}, {})
    assert widest == len(reqs)
    fifo = DllmEngineCore(den, tok, eos, base)
    want, want_texts, _ = drive(fifo, {0: reqs}, {})
    for r in reqs:
        rid = r.request_id
        assert got[rid].token_ids == want[rid].token_ids and got[rid].finish_reason == want[rid].finish_reason
        assert texts[rid] == want_texts[rid] and got[rid].text == want[rid].text


def test_what_cannot_be_batched_is_refused(model):
    den, tok = model
    assert not batchable(den, DllmConfig(cache=CacheMode.NONE))
    bidi = MaskDenoiser(den.hf, den.mask_token_id, 4, full_bidirectional=True)
    assert not batchable(bidi, DllmConfig())
    with pytest.raises(InvalidParameterError):
        DllmBatchedEngineCore(bidi, tok, frozenset(), DllmConfig())
