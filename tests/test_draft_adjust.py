"""Drafters see the request's penalties and grammar mask (sampling/draft_adjust.py).

Three claims: (1) DraftAdjust computes at a drafted node exactly the adjustment the target's row gets there;
(2) every drafter stays lossless with it — greedy token-identical, batched and alone, and sampling in the exact
penalized law, since q is now the adjusted distribution a drafter draws from; (3) it is not vacuous: the target
drafting for itself accepts every drafted token under penalties or a grammar, and does not when its rows are
left unadjusted.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from lossless import SAMPLING_ALPHA, greedy_outputs_match
from stats import chi_square_pvalue
from test_batch_exact import _drafters
from test_sampling_surface import exact_penalized
from tiny import make_eagle3, make_target

from byblock import SamplingParams, generate
from byblock.drafters import ModelDrafter
from byblock.drafters.base import UnadjustedDrafter
from byblock.drafters.eagle3 import Eagle3Drafter
from byblock.engine.spec_loop import speculative_decode
from byblock.engine.types import SpecStats
from byblock.sampling.draft_adjust import DraftAdjust
from byblock.sampling.grammar import Grammar, GrammarKind
from byblock.sampling.penalties import Penalties
from byblock.sampling.processors import process_logits

PEN = dict(repetition_penalty=1.5, presence_penalty=0.8, frequency_penalty=0.6, logit_bias={7: 1.5})
REGEX = Grammar(GrammarKind.REGEX, "(ab|a[0-9]+|The |de)+")
PROMPT = [5, 17, 33, 9, 5, 17, 33]


@functools.cache
def target():
    return make_target("llama", packed=True)


@functools.cache
def drafters() -> dict:
    t = target()
    named = _drafters(t)
    named["eagle3"] = Eagle3Drafter(make_eagle3(t), t, depth=4)
    named["eagle3tree"] = Eagle3Drafter(make_eagle3(t), t, depth=4, budget=10, top_k=3)
    vocab = torch.arange(0, t.vocab_size, 2)  # a draft vocabulary of every other id: the mapped path
    named["eagle3small"] = Eagle3Drafter(make_eagle3(t, draft_vocab=vocab), t, depth=4)
    return named


def test_row_is_the_targets_adjustment_at_that_node():
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(**PEN)
    pen = Penalties(p, [1, 2, 3, 3], 16, torch.device("cpu"))
    pen.append([3, 4, 4])
    adjust = DraftAdjust(pen, None, 16)
    logits = torch.randn(16, generator=g)
    torch.testing.assert_close(adjust.row(logits, [5, 4]), pen.row(logits, [5, 4]), rtol=0, atol=0)
    vocab = torch.tensor([0, 3, 4, 5, 7, 9])  # a drafter with its own vocabulary reads the same values back
    full = pen.row(logits, [5, 4])
    torch.testing.assert_close(adjust.row(logits[vocab], [5, 4], vocab), full[vocab], rtol=0, atol=0)
    block = torch.randn(3, 16, generator=g)  # unknown paths: the committed state on every row
    want = torch.stack([pen.row(r) for r in block])
    torch.testing.assert_close(adjust.rows(block), want, rtol=0, atol=0)


def test_a_chain_is_adjusted_with_the_path_drafted_before_each_position():
    p = SamplingParams(repetition_penalty=3.0)
    pen = Penalties(p, [], 8, torch.device("cpu"))
    adjust = DraftAdjust(pen, None, 8)
    logits = torch.tensor([[0.0, 2.0, 1.9, 0, 0, 0, 0, 0]]).repeat(3, 1)  # token 1 best everywhere, 2 close
    ids, qs = adjust.chain(logits, SamplingParams(), None)
    assert ids == [1, 2, 1]  # position 1 sees token 1 drafted and penalised, position 2 both
    assert qs == []
    ids, qs = adjust.chain(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert len(qs) == 3 and all(abs(float(q.sum()) - 1) < 1e-5 for q in qs)


def _acceptance(result) -> float:
    s = result.stats
    return sum(s.position_accepted) / max(1, sum(s.position_drafted))


@pytest.mark.parametrize("which", ["penalties", "grammar"])
def test_the_target_drafting_for_itself_accepts_every_token(which):
    t = target()
    extra = PEN if which == "penalties" else {"grammar": REGEX}
    p = SamplingParams(max_new_tokens=40, ignore_eos=which == "penalties", **extra)
    own = ModelDrafter(t, target_vocab=t.vocab_size, block_size=4)  # the target's weights: its rows are p
    _, spec = greedy_outputs_match(t, PROMPT, p, own)
    assert _acceptance(spec) == 1.0
    _, blind = greedy_outputs_match(t, PROMPT, p, UnadjustedDrafter(own.fork()))
    # Unadjusted, it drafts what the penalties / mask turn the target from (a chain the grammar refuses is cut
    # there before verification, so fewer tokens per round rather than rejected ones).
    assert blind.stats.mean_accepted < spec.stats.mean_accepted - 0.5


@pytest.mark.parametrize(
    "name",
    ["dflash", "ddtree", "hybrid", "domino", "dominotree", "model", "adaptive", "eagle3", "eagle3tree", "eagle3small"],
)
@pytest.mark.parametrize("which", ["penalties", "grammar"])
def test_every_drafter_stays_lossless_with_the_adjustments(name, which):
    t = target()
    extra = PEN if which == "penalties" else {"grammar": REGEX}
    p = SamplingParams(max_new_tokens=24, ignore_eos=which == "penalties", **extra)
    for prompt in (PROMPT, [40, 41, 42, 40, 41]):
        greedy_outputs_match(t, prompt, p, drafters()[name].fork())


@pytest.mark.parametrize("name", ["dflash", "dominotree", "eagle3tree", "hybrid"])
def test_batched_requests_with_adjustments_match_their_solo_runs(name):
    t = target()
    prompts = [PROMPT, [40, 41, 42, 40, 41], [7, 7, 7, 8]]
    params = [
        SamplingParams(max_new_tokens=20, ignore_eos=True, **PEN),
        SamplingParams(max_new_tokens=16, grammar=REGEX),
        SamplingParams(max_new_tokens=18, temperature=0.9, seed=3, **PEN),
    ]
    base = drafters()[name]
    batched = generate(t, prompts, params, drafter=base)
    for got, prompt, q in zip(batched, prompts, params, strict=True):
        assert got.token_ids == generate(t, prompt, q, drafter=base.fork()).token_ids


def test_the_target_sampling_for_itself_keeps_the_exact_penalized_law():
    """End to end: the drafter's q is its adjusted distribution; drafting as the target, it is accepted often."""
    t = target()
    prompt = [5, 17, 33, 9, 5, 17]
    p = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=4, repetition_penalty=1.5, frequency_penalty=1.0)
    exact = exact_penalized(t, prompt, p, 3)
    drafter = ModelDrafter(t, target_vocab=t.vocab_size, block_size=3)
    g = torch.Generator().manual_seed(0)
    samples, stats = [], SpecStats()
    for _ in range(1500):
        loop = speculative_decode(t, drafter, prompt, p, g, stats)
        samples.append(tuple(next(loop).token_id for _ in range(3)))
        loop.close()
    assert chi_square_pvalue(samples, exact) > SAMPLING_ALPHA
    assert stats.mean_accepted > 1.8  # not vacuous: most drafted tokens pass through the acceptance test


# ---- the block drafters' chain (DraftAdjust.chain) under the exact law, on a toy LM where drafts are accepted ----

TOY = SamplingParams(temperature=0.9, top_k=4, repetition_penalty=2.0, frequency_penalty=1.0, max_new_tokens=3)


def _toy_samples(chain, n: int = 6000) -> list[tuple[int, ...]]:
    """Speculative sampling with a block drafter (one distribution per position, as DFlash drafts) whose chain
    is picked by `chain`; the target's rows adjusted along each node's path, as the engine does."""
    from test_lossless_sampling import DRAFT, PREFIX, TARGET, V

    from byblock.verify import verify
    from byblock.verify.types import Draft

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ctx, emitted = list(PREFIX), []
        pen = Penalties(TOY, PREFIX, V, torch.device("cpu"))
        while len(emitted) < TOY.max_new_tokens:
            ids, qs = chain(DraftAdjust(pen, None, V), DRAFT.logits(ctx).repeat(3, 1), TOY, g)
            rows = [pen.row(TARGET.logits(ctx + ids[:i]), ids[:i]) for i in range(len(ids) + 1)]
            verdict = verify(Draft.chain(ids, q=torch.stack(qs)), torch.stack(rows), TOY, g)
            pen.append(verdict.tokens)
            ctx += verdict.tokens
            emitted += verdict.tokens
        out.append(tuple(emitted[: TOY.max_new_tokens]))
    return out


def _toy_exact() -> dict[tuple[int, ...], float]:
    from test_lossless_sampling import PREFIX, TARGET, V

    exact = {}
    for seq in itertools.product(range(V), repeat=TOY.max_new_tokens):
        prob, ctx, pen = 1.0, list(PREFIX), Penalties(TOY, PREFIX, V, torch.device("cpu"))
        for tok in seq:
            prob *= float(process_logits(pen.row(TARGET.logits(ctx)), TOY)[tok])
            pen.append([tok])
            ctx.append(tok)
        if prob > 0:
            exact[seq] = prob
    return exact


def test_an_adjusted_block_chain_keeps_the_exact_penalized_law():
    assert chi_square_pvalue(_toy_samples(DraftAdjust.chain), _toy_exact()) > SAMPLING_ALPHA


def test_the_law_test_catches_a_chain_that_records_the_unadjusted_q():
    """Power: drawing from the adjusted rows but handing verification the raw q breaks the law."""

    def wrong(adjust, logits, params, generator):
        ids, _ = adjust.chain(logits, params, generator)
        return ids, [process_logits(logits[d], params) for d in range(len(ids))]

    assert chi_square_pvalue(_toy_samples(wrong), _toy_exact()) < SAMPLING_ALPHA


@pytest.mark.parametrize("kind", ["lowers", "raises"])  # the greedy shortcut, and the general path
def test_the_blockwise_chain_equals_the_row_by_row_definition(kind):
    g = torch.Generator().manual_seed(3)
    p = SamplingParams(**PEN) if kind == "lowers" else SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5)
    pen = Penalties(p, [1, 2, 3, 3, 9], 32, torch.device("cpu"))
    pen.append([3, 4, 4, 11])
    adjust = DraftAdjust(pen, None, 32)
    vocab = torch.tensor(sorted(set(range(0, 32, 2)) | {3, 9, 11}))
    for v, bump in itertools.product((None, vocab), (0.0, 6.0)):
        block = torch.randn(6, 32 if v is None else len(v), generator=g) * 3
        block[:, 5] += bump  # one token (unseen so far) best everywhere: later rows find it on their path
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
            ids, qs = adjust.chain(block, params, torch.Generator().manual_seed(0), v)
            path = [int(v[i]) if v is not None else i for i in ids]
            rows = [adjust.row(block[d], path[:d], v) for d in range(len(ids))]
            assert len(ids) == 6
            if params.greedy:
                assert ids == [int(r.argmax()) for r in rows]
            else:
                for q, r in zip(qs, rows, strict=True):
                    torch.testing.assert_close(q, process_logits(r, params), rtol=0, atol=0)


def test_the_greedy_grammar_chain_equals_the_masked_rows():
    """Under a grammar the greedy chain checks the row's best token first and masks only when it is refused;
    either way each position is the masked row's argmax."""
    from byblock.sampling.grammar import Constraint

    t = target()
    grammar = Constraint(REGEX, t.tokenizer, t.vocab_size, tuple(t.eos_token_ids), torch.device("cpu"))
    adjust = DraftAdjust(None, grammar, t.vocab_size)
    g = torch.Generator().manual_seed(5)
    block = torch.randn(8, t.vocab_size, generator=g)
    path: list[int] = []
    for d in range(8):  # even rows: the raw best token is one the grammar takes; odd rows: left to chance
        allowed = torch.isfinite(adjust.row(torch.zeros(t.vocab_size), path)).nonzero().flatten()
        if d % 2 == 0:
            block[d, allowed[int(torch.randint(len(allowed), (1,), generator=g))]] += 10.0
        path.append(int(adjust.row(block[d], path).argmax()))
    ids, _ = adjust.chain(block, SamplingParams(), None)
    assert ids == path[: len(ids)] and len(ids) >= 4
