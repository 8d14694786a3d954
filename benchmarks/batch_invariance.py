"""How often a batched request's tokens differ from its solo run, per dtype and kernel path: the divergence
rate issue 33 asks to measure where batch invariance is not guaranteed.

Every dev prompt is decoded alone (`generate`) and then all together through the batched engine (one
`generate([...])` call, chunked prefill at a small row budget so long prompts are chunked too). Reported per
configuration: requests token-identical to their solo run, the share of generated tokens before the first
divergence, and where the first divergence fell.

    python benchmarks/batch_invariance.py --limit 16 --max-new-tokens 48 --dtypes float32,bfloat16
"""

from __future__ import annotations

import argparse

import torch

from byblock import SamplingParams, generate, load_model
from byblock.bench.datasets import load_dev
from byblock.bench.hardware import describe_machine
from byblock.drafters import DrafterSpec, build_drafter
from byblock.engine.scheduler import BatchConfig


def agreement(solo: list[int], batched: list[int]) -> int:
    """Tokens equal before the first divergence."""
    n = 0
    for a, b in zip(solo, batched, strict=False):
        if a != b:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--drafters", default="none,adaptive-hybrid")
    ap.add_argument("--budgets", default="64,2048", help="--max-batched-tokens of the batched runs (64: chunked)")
    args = ap.parse_args()
    torch.manual_seed(0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    print(describe_machine())
    print(
        f"model {args.model}: {args.limit} dev prompts × {args.max_new_tokens} greedy tokens, all batched "
        f"together (chunked prefill: prompts longer than the row budget are chunked)\n"
    )
    print(
        "| dtype | linears | drafter | --max-batched-tokens | requests identical | tokens before first divergence "
        "| first divergence at |"
    )
    print("|---|---|---|---:|---:|---:|---|")
    for dtype in args.dtypes.split(","):
        model = load_model(args.model, dtype=dtype)
        prompts = [model.encode_prompt(p.text, chat=True) for p in load_dev(args.limit)]
        linears = "row-invariant rules" if model.row_invariant else "packed GEMM"
        for name in args.drafters.split(","):
            drafter = None if name == "none" else build_drafter(DrafterSpec.parse(name, tree_budget=31), model)
            solo = [generate(model, ids, params, drafter=drafter.fork() if drafter else None) for ids in prompts]
            total = sum(len(s.token_ids) for s in solo)
            for budget in (int(b) for b in args.budgets.split(",")):
                config = BatchConfig(max_batched_tokens=budget, chunked_prefill=True)  # forced, in bf16 too
                batch = generate(model, prompts, params, drafter=drafter, batch=config)
                same = sum(s.token_ids == b.token_ids for s, b in zip(solo, batch, strict=True))
                agree = [agreement(s.token_ids, b.token_ids) for s, b in zip(solo, batch, strict=True)]
                where = sorted(a for a, s in zip(agree, solo, strict=True) if a < len(s.token_ids))
                print(
                    f"| {dtype} | {linears} | {name} | {budget} | {same}/{len(prompts)} | "
                    f"{100 * sum(agree) / total:.1f} % | {', '.join(f'token {a}' for a in where) or '—'} |"
                )


if __name__ == "__main__":
    main()
