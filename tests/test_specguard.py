"""SpecGuard's step-level acceptance: the step check against a written-out reference, its bounds (never fewer
tokens than lossless, identical when no step can pass), and the CLI's lossy warning."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny import make_target

from byblock import SamplingParams, generate
from byblock.drafters import NgramConfig, NgramDrafter
from byblock.errors import InvalidParameterError
from byblock.verify import Draft
from byblock.verify.specguard import SpecGuardConfig, delimiter_ids, guarded_length

NL = 9  # the delimiter token in the synthetic cases


def _rows(argmax: list[int], vocab: int = 16, sharp: float = 4.0) -> torch.Tensor:
    rows = torch.zeros(len(argmax), vocab)
    rows[torch.arange(len(argmax)), torch.tensor(argmax)] = sharp
    return rows


def _reference(tokens, rows, accepted, ends, cfg) -> int:
    """The rule written out: whole steps in order, each kept iff all three scores pass."""
    keep, start = accepted, 0
    for end in [i + 1 for i, t in enumerate(tokens) if t in ends]:
        if end > accepted:
            lp = [float(torch.log_softmax(rows[i], -1)[tokens[i]]) for i in range(start, end)]
            agree = sum(int(rows[i].argmax()) == tokens[i] for i in range(start, end)) / (end - start)
            if not (sum(lp) / len(lp) >= cfg.min_mean_logprob and min(lp) >= cfg.min_token_logprob):
                break
            if agree < cfg.min_agreement:
                break
            keep = end
        start = end
    return keep


def test_step_check_matches_the_written_out_rule():
    g = torch.Generator().manual_seed(0)
    ends = frozenset({NL})
    for _ in range(300):
        n = int(torch.randint(1, 12, (1,), generator=g))
        tokens = torch.randint(0, 16, (n,), generator=g).tolist()
        argmax = [
            t if torch.rand(1, generator=g) < 0.7 else int(torch.randint(0, 16, (1,), generator=g)) for t in tokens
        ]
        rows = _rows([*argmax, 0]) + 0.5 * torch.randn(n + 1, 16, generator=g)
        accepted = 0
        while accepted < n and int(rows[accepted].argmax()) == tokens[accepted]:
            accepted += 1
        cfg = SpecGuardConfig(min_mean_logprob=-1.5, min_token_logprob=-4.0, min_agreement=0.5)
        got = guarded_length(Draft.chain(tokens), rows, accepted, ends, cfg)
        assert got == _reference(tokens, rows, accepted, ends, cfg)
        assert got >= accepted and (got == accepted or tokens[got - 1] in ends)


def test_a_plausible_step_is_kept_past_a_mismatch_and_an_implausible_one_is_not():
    tokens = [3, 4, 5, NL, 6, 7, NL]
    argmax = [3, 4, 8, NL, 6, 7, NL, 0]  # the target would have written 8 at position 2
    rows = _rows(argmax)
    rows[2, 5] = 3.9  # ... but finds the drafted 5 nearly as likely
    cfg = SpecGuardConfig(min_mean_logprob=-1.5, min_token_logprob=-3.0, min_agreement=0.6)
    assert guarded_length(Draft.chain(tokens), rows, 2, frozenset({NL}), cfg) == 7  # both steps kept
    rows[2, 5] = -5.0  # now the drafted token is implausible: the first step fails, nothing is extended
    assert guarded_length(Draft.chain(tokens), rows, 2, frozenset({NL}), cfg) == 2
    assert (
        guarded_length(Draft.chain([3, 4, 5, 6]), _rows([3, 4, 8, 6, 0]), 2, frozenset({NL}), cfg) == 2
    )  # no delimiter


def test_bad_thresholds_are_one_line_errors():
    with pytest.raises(InvalidParameterError):
        SpecGuardConfig(min_agreement=1.5)
    with pytest.raises(InvalidParameterError):
        SpecGuardConfig(min_mean_logprob=0.5)


@pytest.fixture(scope="module")
def target():
    return make_target("llama", packed=True)


def test_engine_never_keeps_less_and_is_lossless_when_no_step_can_pass(target):
    prompt = "The quick brown fox jumps over the lazy dog.\nThe quick brown fox"
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    drafter = NgramDrafter(NgramConfig(block_size=8))
    plain = generate(target, prompt, params)
    never = SpecGuardConfig(min_mean_logprob=0.0, min_token_logprob=0.0, min_agreement=1.0)
    strict = generate(target, prompt, params, drafter=drafter.fork(), guard=never)
    assert strict.token_ids == plain.token_ids and strict.stats.guard_tokens == 0
    loose = SpecGuardConfig(min_mean_logprob=-1e9, min_token_logprob=-1e9, min_agreement=0.0)
    lossy = generate(target, prompt, params, drafter=drafter.fork(), guard=loose)
    lossless = generate(target, prompt, params, drafter=drafter.fork())
    assert len(lossy.token_ids) == 40
    assert lossy.stats.rounds <= lossless.stats.rounds  # keeping more per round never needs more rounds
    assert delimiter_ids(target.tokenizer, loose)  # the tiny tokenizer has newline tokens


def test_cli_warns_that_specguard_is_lossy(tiny_llama_dir):
    base = [sys.executable, "-m", "byblock.cli.main", "generate", "a\nb\na", "--model", str(tiny_llama_dir)]
    ok = subprocess.run(
        [*base, "--drafter", "ngram", "--verify", "specguard", "--max-new-tokens", "8"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert "NOT lossless" in ok.stderr and "specguard kept" in ok.stderr
    bad = subprocess.run([*base, "--verify", "specguard"], capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "needs a drafter" in bad.stderr
