"""What the OpenAI sampling surface costs and whether drafting still pays under it: penalties, a JSON-schema
grammar (llguidance masks), logprobs — each with plain decoding and with lossless drafters, on the default model.

Per mode the drafters are checked token-identical to that mode's plain decoding (greedy, so a penalized or
constrained plain answer is the reference), and logprobs equal to 1e-5. Methods interleave per prompt. In the
modes that adjust logits (penalties, grammar) each model drafter also runs "unadjusted": handed no DraftAdjust,
as drafters ran before they saw the request's penalties and mask (the A/B of sampling/draft_adjust.py).

    python benchmarks/sampling_surface.py --limit 8 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json

import torch

from byblock import SamplingParams, generate, load_model
from byblock.bench.datasets import load_dev
from byblock.bench.hardware import describe_machine
from byblock.drafters import DrafterSpec, build_drafter
from byblock.drafters.base import UnadjustedDrafter
from byblock.sampling.grammar import Grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 200},
        "confidence": {"type": "number"},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
    },
    "required": ["answer", "confidence", "keywords"],
    "additionalProperties": False,
}


UNADJUSTED = " (unadjusted)"


def modes(max_new: int) -> dict[str, SamplingParams]:
    """The sampling settings compared (all greedy)."""
    base = dict(max_new_tokens=max_new)
    return {
        "free": SamplingParams(**base),
        "logprobs=5": SamplingParams(**base, logprobs=5),
        "penalties": SamplingParams(**base, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3),
        "penalties-strong": SamplingParams(**base, repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.8),
        "json-schema": SamplingParams(**base, grammar=Grammar.json_schema(SCHEMA)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafters", default="none,ngram,dflash,adaptive-hybrid")
    ap.add_argument("--modes", default="free,logprobs=5,penalties,penalties-strong,json-schema")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model)
    drafters = {}
    for name in args.drafters.split(","):
        spec = DrafterSpec.parse(name, tree_budget=31) if name != "ngram" else DrafterSpec.parse(name, block_size=8)
        drafters[name] = build_drafter(spec, model)
    prompts = [model.encode_prompt(p.text + "\nAnswer as JSON.", chat=True) for p in load_dev(args.limit)]
    rows = []
    for mode, params in modes(args.max_new_tokens).items():
        if mode not in args.modes.split(","):
            continue
        for ids in prompts[:1]:  # warm-up (builds the grammar's tokenizer view once)
            generate(model, ids, params)
        arms = dict(drafters)
        if params.adjusts_logits or params.grammar is not None:  # the A/B: the same drafters, unadjusted
            arms.update({d + UNADJUSTED: UnadjustedDrafter(v) for d, v in drafters.items() if v and d != "ngram"})
        tot = {d: [0, 0.0, 0, 0, 0.0] for d in arms}  # tokens, seconds, rounds, emitted, drafting seconds
        mismatch = dict.fromkeys(arms, 0)
        for i, ids in enumerate(prompts):
            names = list(arms)
            names = names[i % len(names) :] + names[: i % len(names)]
            out = {}
            for d in names:
                r = generate(model, ids, params, drafter=arms[d].fork() if arms[d] else None)
                out[d] = r
                t = tot[d]
                t[0] += r.num_new_tokens
                t[1] += r.total_s
                t[2] += r.stats.rounds
                t[3] += r.stats.emitted_by_rounds
                t[4] += r.stats.draft_s
            for d in arms:
                same = out[d].token_ids == out["none"].token_ids
                if same and params.logprobs is not None:
                    same = all(
                        abs(a.logprob - b.logprob) < 1e-5
                        for a, b in zip(out[d].logprobs, out["none"].logprobs, strict=True)
                    )
                mismatch[d] += not same
        base = tot["none"][0] / tot["none"][1]
        for d, (n, s, rounds, emitted, draft_s) in tot.items():
            rows.append(
                {
                    "mode": mode,
                    "drafter": d,
                    "tokens": n,
                    "tok_s": round(n / s, 2),
                    "vs_mode_plain": round(n / s / base, 3),
                    "tau": round(emitted / rounds, 2) if d != "none" and rounds else None,
                    "draft_ms": round(draft_s / rounds * 1e3, 2) if d != "none" and rounds else None,
                    "identical": f"{len(prompts) - mismatch[d]}/{len(prompts)}",
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    free = {r["drafter"]: r["tok_s"] for r in rows if r["mode"] == "free"}
    print(
        f"\nmachine: {describe_machine()}; model {args.model} ({model.weights}); {len(prompts)} dev prompts, "
        f"{args.max_new_tokens} new tokens, greedy, batch 1\n"
    )
    print("| mode | drafter | tok/s | vs the mode's plain | vs free plain | τ | draft ms / round | identical |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tau = r["tau"] if r["tau"] is not None else "—"
        vs_free = f"{r['tok_s'] / free['none']:.2f}×" if "none" in free else "—"  # free mode not run
        draft_ms = r["draft_ms"] if r["draft_ms"] is not None else "—"
        print(
            f"| {r['mode']} | {r['drafter']} | {r['tok_s']} | {r['vs_mode_plain']:.2f}× | {vs_free} | {tau} | "
            f"{draft_ms} | {r['identical']} |"
        )


if __name__ == "__main__":
    main()
