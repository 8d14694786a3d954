"""DFlash vs plain decoding vs prompt lookup on the default model, in one interleaved run.

Greedy, batch 1: dev prompts (chat, a fixed subset) and HumanEval prompts (raw completion). Methods run
back to back on each prompt, in alternating order, so machine drift hits all alike; every speculative run
is checked token-identical to plain decoding. Reports τ, tokens/s, speedup, per-position acceptance, draft
vs verify time per round and the round-cost ratio (round time ÷ plain per-token time: the τ at which
the method breaks even). A second pass at temperature 1 reports τ under lossless speculative sampling.

    python benchmarks/spec_dflash.py --limit 10 --max-new-tokens 128 [--drafter PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from byblock import SamplingParams, generate, load_model
from byblock.bench.datasets import load_dev, load_humaneval
from byblock.bench.hardware import describe_machine
from byblock.drafters import DrafterSpec, build_drafter


def method_specs(drafter_path: str | None, blocks: list[int]) -> dict[str, DrafterSpec | None]:
    """Method name -> drafter spec (None = plain decoding)."""
    dflash = f"dflash:{drafter_path}" if drafter_path else "dflash"
    specs: dict[str, DrafterSpec | None] = {"plain": None, "ngram-b8": DrafterSpec.parse("ngram", block_size=8)}
    for b in blocks:
        specs[f"dflash-b{b}"] = DrafterSpec.parse(dflash, block_size=b)
    return specs


def run_dataset(model, prompts, drafters, params) -> dict:
    """Every method on every prompt (interleaved); aggregate counters per method."""
    names = list(drafters)
    agg = {
        m: {"tokens": 0, "time": 0.0, "rounds": 0, "emitted": 0, "identical": True, "draft_s": 0.0, "verify_s": 0.0}
        for m in names
    }
    pos_drafted: dict[str, list[int]] = {m: [] for m in names}
    pos_accepted: dict[str, list[int]] = {m: [] for m in names}
    for i, prompt in enumerate(prompts):
        ids = model.encode_prompt(prompt.text, chat=prompt.chat)
        order = names if i % 2 == 0 else names[::-1]
        results = {name: generate(model, ids, params, drafter=drafters[name]) for name in order}
        for name, res in results.items():
            a = agg[name]
            a["tokens"] += res.num_new_tokens
            a["time"] += res.total_s
            a["rounds"] += res.stats.rounds
            a["emitted"] += res.stats.emitted_by_rounds
            a["draft_s"] += res.stats.draft_s
            a["verify_s"] += res.stats.verify_s
            if params.greedy:
                a["identical"] &= res.token_ids == results["plain"].token_ids
            for lst, src in (
                (pos_drafted[name], res.stats.position_drafted),
                (pos_accepted[name], res.stats.position_accepted),
            ):
                lst.extend([0] * (len(src) - len(lst)))
                for d, n in enumerate(src):
                    lst[d] += n
    plain = agg["plain"]
    per_token = plain["time"] / plain["tokens"]
    table = {}
    for name, a in agg.items():
        tps = a["tokens"] / a["time"]
        rounds = max(1, a["rounds"])
        round_s = (a["draft_s"] + a["verify_s"]) / rounds
        table[name] = {
            "tok_s": round(tps, 2),
            "speedup": round(tps * per_token, 3),
            "tau": round(a["emitted"] / rounds, 3) if a["rounds"] else 1.0,
            "identical": a["identical"] if params.greedy else None,
            "tokens": a["tokens"],
            "draft_ms_per_round": round(1e3 * a["draft_s"] / rounds, 2),
            "verify_ms_per_round": round(1e3 * a["verify_s"] / rounds, 2),
            "round_cost_ratio": round(round_s / per_token, 3),
            "per_position_acceptance": [
                round(acc / dr, 3) if dr else 0.0
                for acc, dr in zip(pos_accepted[name], pos_drafted[name], strict=False)
            ],
        }
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="DFlash checkpoint dir (default: the shipped one)")
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sampled-limit", type=int, default=5, help="prompts per dataset for the temperature-1 pass")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    machine = describe_machine()
    print(f"machine: {machine}")
    model = load_model(args.model)
    blocks = [int(b) for b in args.blocks.split(",")]
    specs = method_specs(args.drafter, blocks)
    drafters = {name: build_drafter(spec, model) if spec else None for name, spec in specs.items()}
    some_dflash = next(d for n, d in drafters.items() if n.startswith("dflash"))
    provenance = some_dflash.model.config.extra if some_dflash is not None else {}
    datasets = {"dev": load_dev(args.limit), "humaneval": load_humaneval(args.limit)}
    generate(model, "warm up", SamplingParams(max_new_tokens=8), drafter=some_dflash)
    report: dict = {
        "machine": machine,
        "model": args.model,
        "drafter": args.drafter or "shipped",
        "drafter_provenance": provenance,
        "max_new_tokens": args.max_new_tokens,
        "greedy": {},
        "temperature_1": {},
    }
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens)
    for ds, prompts in datasets.items():
        table = run_dataset(model, prompts, drafters, greedy)
        report["greedy"][ds] = {"prompts": len(prompts), "methods": table}
        for name, row in table.items():
            print(
                f"greedy {ds:9s} {name:10s} {row['tok_s']:6.2f} tok/s  x{row['speedup']:.2f}  τ {row['tau']:.2f}  "
                f"round {row['draft_ms_per_round']:.1f}+{row['verify_ms_per_round']:.1f} ms "
                f"(cost x{row['round_cost_ratio']:.2f})  identical {row['identical']}"
            )
    sampled = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    for ds, prompts in datasets.items():
        table = run_dataset(model, prompts[: args.sampled_limit], drafters, sampled)
        report["temperature_1"][ds] = {"prompts": min(len(prompts), args.sampled_limit), "methods": table}
        for name, row in table.items():
            print(f"T=1    {ds:9s} {name:10s} {row['tok_s']:6.2f} tok/s  x{row['speedup']:.2f}  τ {row['tau']:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
