"""SpecGuard (lossy, step-level acceptance) against plain decoding and lossless drafting on arithmetic word
problems with a checker: accuracy, tokens/s, τ, and the share of tokens kept that lossless verification would
have rejected.

The problems are generated from a seed (one- and two-step additions, subtractions, products); an answer counts
when the number after the last "Answer:" (else the last number in the text) is the right one.

    python benchmarks/specguard_math.py --problems 20 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import random
import re
import time

import torch

from byblock import SamplingParams, generate, load_model
from byblock.bench.hardware import describe_machine
from byblock.drafters import DrafterSpec, build_drafter
from byblock.verify.specguard import SpecGuardConfig

INSTRUCTION = "\nSolve it step by step, one short step per line, and end with 'Answer: <number>'."
NAMES = ("Tom", "Sara", "Ali", "Mei", "Lena", "Omar")
ITEMS = ("apples", "coins", "pencils", "stickers", "books", "marbles")


def make_problems(n: int, seed: int) -> list[tuple[str, int]]:
    """(question, answer) pairs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        who, what = rng.choice(NAMES), rng.choice(ITEMS)
        a, b, c = rng.randint(2, 40), rng.randint(2, 20), rng.randint(1, 9)
        kind = i % 4
        if kind == 0:
            q = f"{who} has {a} {what}. {who} gets {b} more {what}. How many {what} does {who} have now?"
            out.append((q, a + b))
        elif kind == 1:
            a = a + b
            out.append((f"{who} has {a} {what} and gives away {b} of them. How many {what} are left?", a - b))
        elif kind == 2:
            b = rng.randint(2, 9)
            out.append((f"{who} has {b} bags with {c} {what} in each bag. How many {what} are there in total?", b * c))
        else:
            out.append(
                (f"{who} has {a} {what}, buys {b} more and then loses {c}. How many {what} does {who} have?", a + b - c)
            )
    return out


def answer_of(text: str) -> int | None:
    """The number after the last 'Answer:', else the last number in the text."""
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    nums = re.findall(r"-?\d+", tail)
    return int(nums[-1 if "Answer:" not in text else 0]) if nums else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--problems", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafter", default="dflash", help="a chain drafter (SpecGuard checks chains)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model)
    drafter = build_drafter(DrafterSpec.parse(args.drafter), model)
    problems = make_problems(args.problems, args.seed)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    methods = [
        ("plain", None, None),
        (f"{args.drafter} (lossless)", drafter, None),
        (f"{args.drafter} + specguard (default)", drafter, SpecGuardConfig()),
        (
            f"{args.drafter} + specguard (loose: mean ≥ -2, agree ≥ 0.3)",
            drafter,
            SpecGuardConfig(min_mean_logprob=-2.0, min_token_logprob=-8.0, min_agreement=0.3),
        ),
    ]
    generate(model, problems[0][0], SamplingParams(max_new_tokens=8))  # warm-up
    print(describe_machine())
    n, m = len(problems), args.max_new_tokens
    print(f"model {args.model}: {n} generated arithmetic word problems, greedy, {m} tokens\n")
    print("| method | accuracy | tok/s | speedup | τ | tokens kept by the step check | same text as plain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    plain_texts, base = None, 0.0
    for name, d, guard in methods:
        correct, tokens, rounds, emitted, guarded, texts = 0, 0, 0, 0, 0, []
        t0 = time.perf_counter()
        for q, want in problems:
            res = generate(model, q + INSTRUCTION, params, drafter=d.fork() if d else None, guard=guard)
            correct += answer_of(res.text) == want
            tokens += len(res.token_ids)
            rounds += res.stats.rounds
            emitted += res.stats.emitted_by_rounds
            guarded += res.stats.guard_tokens
            texts.append(res.text)
        tps = tokens / (time.perf_counter() - t0)
        plain_texts = plain_texts or texts
        base = base or tps
        same = sum(a == b for a, b in zip(texts, plain_texts, strict=True))
        tau = emitted / rounds if d else 1.0
        print(
            f"| {name} | {correct}/{len(problems)} | {tps:.1f} | {tps / base:.2f}× | {tau:.2f} | "
            f"{100 * guarded / tokens:.1f} % | {same}/{len(problems)} |"
        )


if __name__ == "__main__":
    main()
