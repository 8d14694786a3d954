"""Sampling losslessness, checked statistically.

Claim under test: the first n emitted tokens of speculative sampling have exactly the joint distribution
of plain sampling from p (after temperature / top-k / top-p), for chains and trees, deterministic and
stochastic drafts. Test: chi-square goodness of fit against the exactly computed joint, α = 1e-3 per test
(seeded, so each test is deterministic). Power check: deliberately wrong verifiers must be rejected at
the same α with the same sample size.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from lossless import sampling_pvalue
from stats import chi_square_pvalue
from tiny import make_target

from byblock import SamplingParams
from byblock.drafters import ModelDrafter, NgramConfig, NgramDrafter
from byblock.sampling.processors import process_logits, sample
from byblock.verify import verify
from byblock.verify.rejection import rejection_chain
from byblock.verify.types import Draft, Noise, Verdict

ALPHA = 1e-3
V = 6  # toy vocabulary
N_TOKENS = 3  # joint distribution of the first 3 emitted tokens
SAMPLES = 6000
PARAMS = SamplingParams(temperature=0.9, top_k=4, top_p=0.95, max_new_tokens=N_TOKENS)


class ToyLM:
    """Logits depend on the last two tokens: a tiny, exactly-computable language model."""

    def __init__(self, seed: int, scale: float = 1.5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V, V, V, generator=g) * scale

    def logits(self, ctx: list[int]) -> torch.Tensor:
        return self.table[ctx[-2], ctx[-1]]

    def probs(self, ctx: list[int]) -> torch.Tensor:
        return process_logits(self.logits(ctx), PARAMS)


TARGET, DRAFT = ToyLM(0), ToyLM(1)
PREFIX = [0, 1]


def draft_for(kind: str, ctx: list[int], g: torch.Generator) -> Draft:
    """Drafts of four kinds from the toy draft model."""
    if kind in ("chain-stochastic", "chain-deterministic"):
        toks, qs, c = [], [], list(ctx)
        for _ in range(3):
            q = DRAFT.probs(c)
            x = int(sample(q, g)) if kind == "chain-stochastic" else int(q.argmax())
            toks.append(x)
            qs.append(q)
            c.append(x)
        return Draft.chain(toks, q=torch.stack(qs) if kind == "chain-stochastic" else None)
    # trees: two children of the root, each with two children (top-2 or sampled-without-replacement)
    toks, parents = [], []
    q0 = DRAFT.probs(ctx)
    first = (
        q0.topk(2).indices.tolist() if kind == "tree-deterministic" else torch.multinomial(q0, 2, generator=g).tolist()
    )
    for a in first:
        toks.append(a)
        parents.append(-1)
        node = len(toks) - 1
        q1 = DRAFT.probs([*ctx, a])
        second = (
            q1.topk(2).indices.tolist()
            if kind == "tree-deterministic"
            else torch.multinomial(q1, 2, generator=g).tolist()
        )
        for b in second:
            toks.append(b)
            parents.append(node)
    return Draft(tokens=torch.tensor(toks), parents=torch.tensor(parents))


def target_rows(draft: Draft, ctx: list[int]) -> torch.Tensor:
    """[N+1, V] target logits: the root's, then each node's given its ancestors (what one tree forward gives)."""
    rows = [TARGET.logits(ctx)]
    paths: list[list[int]] = []
    for i in range(draft.num_nodes):
        p = int(draft.parents[i])
        path = ([] if p < 0 else paths[p]) + [int(draft.tokens[i])]
        paths.append(path)
        rows.append(TARGET.logits(ctx + path))
    return torch.stack(rows)


def run_many(kind: str, verifier, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(SAMPLES):
        ctx, emitted = list(PREFIX), []
        while len(emitted) < N_TOKENS:
            draft = draft_for(kind, ctx, g)
            verdict = verifier(draft, target_rows(draft, ctx), PARAMS, g)
            ctx += verdict.tokens
            emitted += verdict.tokens
        out.append(tuple(emitted[:N_TOKENS]))
    return out


def exact_joint() -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=N_TOKENS):
        prob, ctx = 1.0, list(PREFIX)
        for t in seq:
            prob *= float(TARGET.probs(ctx)[t])
            ctx.append(t)
        if prob > 0:
            joint[seq] = prob
    return joint


EXACT = exact_joint()
KINDS = ["chain-stochastic", "chain-deterministic", "tree-deterministic", "tree-stochastic"]


@pytest.mark.parametrize("kind", KINDS)
def test_speculative_sampling_matches_target_distribution(kind):
    samples = run_many(kind, verify, seed=KINDS.index(kind))
    assert chi_square_pvalue(samples, EXACT) > ALPHA


# ---- deliberately wrong verifiers: the test above must catch each of them -------------------------------


def forgets_residual(draft, logits, params, g):
    """On rejection, resample from p instead of norm(max(p - q, 0))."""
    p = process_logits(logits, params)
    noise = Noise.draw(draft.num_nodes, p.shape[-1], g, "cpu")
    good = rejection_chain(draft, p, noise)
    if good.num_accepted < draft.num_nodes:
        a = good.num_accepted
        return Verdict(path=good.path, tokens=[*good.tokens[:a], int((p[a] / noise.exp_row(a)).argmax())])
    return good


def ignores_q(draft, logits, params, g):
    """Accept x with probability p(x) (no division by q), then resample from p."""
    p = process_logits(logits, params)
    for i in range(draft.num_nodes):
        x = int(draft.tokens[i])
        if float(torch.rand(1, generator=g)) >= float(p[i, x]):
            return Verdict(path=list(range(i)), tokens=[*draft.tokens[:i].tolist(), int(sample(p[i], g))])
    return Verdict(path=list(range(draft.num_nodes)), tokens=[*draft.tokens.tolist(), int(sample(p[-1], g))])


def off_by_one_row(draft, logits, params, g):
    """Walks the tree but samples each node's successor from its parent's row."""
    p = process_logits(logits, params)
    shifted = torch.cat([p[:1], p[:-1]])
    return verify(draft, shifted.log(), params, g)


@pytest.mark.parametrize(
    ("kind", "bad"),
    [
        ("chain-stochastic", forgets_residual),
        ("chain-stochastic", ignores_q),
        ("tree-deterministic", off_by_one_row),
    ],
)
def test_wrong_verifier_is_caught(kind, bad):
    samples = run_many(kind, bad, seed=99)
    assert chi_square_pvalue(samples, EXACT) < ALPHA


# ---- end to end through the engine with a real (tiny) transformer --------------------------------------


def test_engine_sampling_matches_plain_distribution():
    """speculative_decode on a tiny llama: first 4 tokens, top-k 2, vs the exactly computed joint."""
    target = make_target("llama")
    draft_model = make_target("llama", seed=1)  # same tokenizer, different weights
    params = SamplingParams(temperature=1.0, top_k=2, max_new_tokens=4)
    prompt = [5, 17, 33, 9, 5, 17]

    drafters = {
        "model": ModelDrafter(draft_model, target_vocab=target.vocab_size, block_size=3),
        "ngram-tree": NgramDrafter(NgramConfig(block_size=3, num_candidates=3, min_n=1)),
    }
    for name, drafter in drafters.items():
        assert sampling_pvalue(target, drafter, prompt, params) > ALPHA, name
