"""The benchmark loop: every method on every prompt, interleaved, with a lossless check on every run.

Per prompt the methods run back to back in a rotating order (drift hits all alike); a warm-up per method
is excluded; seeds are fixed. Multi-turn prompts: each method answers turn 1, then sees its own answer
before turn 2, and so on. Under greedy decoding every method's tokens are compared with `ar`'s (plain
decoding) for every turn — a method that changes the output is flagged in the report.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from byblock.bench.datasets import Prompt
from byblock.bench.methods import MethodRunner, TurnResult, engine_plain
from byblock.models.adapter import TargetModel
from byblock.sampling.params import SamplingParams


@dataclass
class MethodTotals:
    """Running sums for one (dataset, method)."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    turns: int = 0
    mismatched_turns: int = 0
    mismatched_vs_engine: int = 0  # another engine's drafter against that engine's plain decoding
    per_prompt_tok_s: list[float] = field(default_factory=list)
    per_turn_tau: list[float] = field(default_factory=list)  # one long accepted run can carry a whole mean

    def add_batch(self, results: list[TurnResult], wall_s: float) -> None:
        """Fold in the turns one batch answered together, timed by the batch's wall clock."""
        for r in results:
            self.add(r, seconds=0.0)
        self.seconds += wall_s

    def add(self, r: TurnResult, seconds: float | None = None) -> None:
        """Fold one turn in (timed by its own clock unless `seconds` says otherwise)."""
        self.tokens += len(r.token_ids)
        self.seconds += r.total_s if seconds is None else seconds
        self.ttft.append(r.ttft_s)
        self.turns += 1
        if r.total_s > 0:
            self.per_prompt_tok_s.append(len(r.token_ids) / r.total_s)
        s = r.stats
        if s is None:
            return
        self.rounds += s.rounds
        self.emitted += s.emitted_by_rounds
        if s.rounds:
            self.per_turn_tau.append(round(s.emitted_by_rounds / s.rounds, 4))
        self.draft_s += s.draft_s
        self.verify_s += s.verify_s
        for mine, theirs in (
            (self.accept_hist, s.accept_counts),
            (self.pos_drafted, s.position_drafted),
            (self.pos_accepted, s.position_accepted),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    def summary(self, baseline_tok_s: float | None) -> dict:
        """The report row."""
        tok_s = self.tokens / self.seconds if self.seconds else 0.0
        spec = self.rounds > 0
        timed = spec and self.draft_s + self.verify_s > 0  # another engine's rows have counts but no phase times
        return {
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tok_s": round(tok_s, 3),
            "speedup": round(tok_s / baseline_tok_s, 4) if baseline_tok_s else None,
            "tau": round(self.emitted / self.rounds, 4) if spec else None,
            "ttft_s_mean": round(statistics.fmean(self.ttft), 5) if self.ttft else None,
            "ttft_s_p50": round(statistics.median(self.ttft), 5) if self.ttft else None,
            "acceptance_histogram": self.accept_hist,
            "per_position_acceptance": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted, strict=False)
            ],
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "draft_fraction": round(self.draft_s / (self.draft_s + self.verify_s), 4) if timed else None,
            "round_ms": round(1e3 * (self.draft_s + self.verify_s) / self.rounds, 3) if timed else None,
            # round time / the baseline's time per token: the τ at which this method breaks even
            "round_cost_ratio": (
                round((self.draft_s + self.verify_s) / self.rounds * baseline_tok_s, 4)
                if timed and baseline_tok_s
                else None
            ),
            "per_turn_tau": self.per_turn_tau if spec else None,
            "turns": self.turns,
            "mismatched_turns": self.mismatched_turns,
            "mismatched_vs_engine": self.mismatched_vs_engine,
        }


def conversation_ids(target: TargetModel, prompt: Prompt, answers: list[list[int]]) -> list[int]:
    """Prompt ids for the next turn: earlier user turns interleaved with this method's own answers."""
    if not prompt.chat:
        return target.encode_prompt(prompt.text, chat=False)
    messages: list[dict[str, str]] = []
    for turn, answer in zip(prompt.user_turns, [*answers, None], strict=False):
        messages.append({"role": "user", "content": turn})
        if answer is None:
            break
        text = target.tokenizer.decode(answer, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
    return target.encode_messages(messages)


def run_chunk(
    target: TargetModel, chunk: list[Prompt], runner: MethodRunner, params: SamplingParams, totals: MethodTotals
) -> list[list[TurnResult]]:
    """All turns of a chunk of prompts with one method, turn t of every prompt as one batch; folds each batch
    into `totals` and returns the answers per prompt."""
    answers: list[list[TurnResult]] = [[] for _ in chunk]
    for turn in range(max(len(p.user_turns) for p in chunk)):
        live = [i for i, p in enumerate(chunk) if turn < len(p.user_turns)]
        ids = [conversation_ids(target, chunk[i], [r.token_ids for r in answers[i]]) for i in live]
        results, wall = runner.run_batch(ids, params)
        totals.add_batch(results, wall)
        for i, r in zip(live, results, strict=True):
            answers[i].append(r)
    return answers


def run_dataset(
    target: TargetModel,
    prompts: list[Prompt],
    runners: dict[str, MethodRunner],
    params: SamplingParams,
    reference: str,
    tick=None,
    batch: int = 1,
    warm: SamplingParams | None = None,
) -> dict[str, MethodTotals]:
    """Interleaved loop over chunks of `batch` prompts; returns totals per method (mismatches counted against
    `reference`; another engine's drafter also against that engine's plain decoding when it runs).

    warm: with batch > 1, every method first runs the first chunk untimed with these params: a batch's first
    prefill touches memory no one-prompt warm-up did, and on a host whose page cache a peer just filled that
    cost the first timed batch up to 0.9 s (dev/LOG.md, session 33)."""
    names = list(runners)
    totals = {n: MethodTotals() for n in names}
    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    if warm is not None and batch > 1 and chunks:
        for name in names:
            run_chunk(target, chunks[0], runners[name], warm, MethodTotals())
    for c, chunk in enumerate(chunks):
        k = c % len(names)
        order = names[k:] + names[:k]  # rotate who goes first
        outputs = {}
        for name in order:
            outputs[name] = run_chunk(target, chunk, runners[name], params, totals[name])
            if tick is not None:
                tick(len(chunk))
        if not params.greedy:
            continue
        for name in names:
            plain = engine_plain(name)  # a peer's drafting is also checked against the same engine's plain output
            refs = [reference] + ([plain] if plain != name and plain in outputs else [])
            for ref_name in refs:
                if name == ref_name:
                    continue
                bad = sum(
                    a.token_ids != b.token_ids
                    for mine, ref in zip(outputs[name], outputs[ref_name], strict=True)
                    for a, b in zip(mine, ref, strict=False)
                )
                if ref_name == reference:
                    totals[name].mismatched_turns += bad
                else:
                    totals[name].mismatched_vs_engine += bad
    return totals
