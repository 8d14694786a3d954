"""What chunked prefill buys the requests already decoding when a long prompt arrives, and that it changes no
token: the batched engine driven step by step, chunked at several row budgets and unchunked.

A few short requests decode; a few steps in, one long prompt arrives. Per mode: the short requests' gaps
between tokens (p50 / p99 / max: the stall an unchunked prefill causes), the long request's time to first
token, the wall time of the whole run, and whether every request's tokens equal the first mode's.

    python benchmarks/chunked_prefill.py --long-tokens 1500 --budgets 256,512
"""

from __future__ import annotations

import argparse
import statistics

import torch

from byblock import SamplingParams, load_model
from byblock.bench.datasets import load_dev
from byblock.bench.hardware import describe_machine
from byblock.drafters import DrafterSpec, build_drafter
from byblock.engine.batched import BatchedEngineCore
from byblock.engine.core import EngineRequest
from byblock.engine.scheduler import BatchConfig
from byblock.models.devices import device_clock


def run(model, drafters, config: BatchConfig, short: list[list[int]], long: list[int], args) -> dict:
    """One engine run: returns tokens per request, the short requests' token gaps, the long one's TTFT."""
    core = BatchedEngineCore(model, drafters, config)
    clock = device_clock(model.device)
    fast = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for i, ids in enumerate(short):
        core.add_request(EngineRequest(f"s{i}", tuple(ids), fast, args.drafter))
    last: dict[str, float] = {}
    gaps: list[float] = []
    tokens: dict[str, list[int]] = {}
    start, arrived, ttft, step = clock(), None, None, 0
    while core.has_unfinished() or arrived is None:
        if step == args.arrive_step:
            arrived = clock()
            params = SamplingParams(max_new_tokens=16, ignore_eos=True)
            core.add_request(EngineRequest("long", tuple(long), params, args.drafter))
        outs = core.step()
        now = clock()
        for out in outs:
            if out.error is not None:
                raise SystemExit(f"error: {out.error}")
            if out.event is not None and out.event.tokens:
                rid = out.request_id
                if rid == "long":
                    ttft = ttft if ttft is not None else now - arrived
                elif rid in last:
                    gaps.append(now - last[rid])
                last[rid] = now
            if out.result is not None:
                tokens[out.request_id] = out.result.token_ids
        step += 1
    return {"tokens": tokens, "gaps": sorted(gaps), "ttft": ttft, "wall": clock() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="none", help="the drafter every request uses (none: plain decoding)")
    ap.add_argument("--short", type=int, default=4, help="requests decoding when the long prompt arrives")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens per short request")
    ap.add_argument("--long-tokens", type=int, default=1500, help="the long prompt's length")
    ap.add_argument("--arrive-step", type=int, default=4)
    ap.add_argument("--budgets", default="256,512", help="--max-batched-tokens values to run chunked")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model)
    drafters = {}
    if args.drafter != "none":
        drafters[args.drafter] = build_drafter(DrafterSpec.parse(args.drafter, tree_budget=31), model)
    dev = load_dev(args.short + 16)
    short = [model.encode_prompt(p.text, chat=True) for p in dev[: args.short]]
    long: list[int] = []
    for p in dev[args.short :] * 20:  # other dev prompts, concatenated to the length asked
        long += model.encode_prompt(p.text, chat=False)
    long = long[: args.long_tokens]
    if len(long) < args.long_tokens:
        raise SystemExit(f"error: only {len(long)} prompt tokens available")
    modes = [("unchunked", BatchConfig(max_batched_tokens=max(2048, args.long_tokens), chunked_prefill=False))]
    modes += [(f"chunked {b}", BatchConfig(max_batched_tokens=int(b))) for b in args.budgets.split(",")]
    run(model, drafters, modes[-1][1], short[:1], long[:64], args)  # warm-up
    print(describe_machine())
    print(
        f"model {args.model}, drafter {args.drafter}: {args.short} short requests × {args.max_new_tokens} tokens, "
        f"a {len(long)}-token prompt arriving at step {args.arrive_step}"
    )
    print()
    print("| mode | token gap p50 ms | p99 ms | max ms | long TTFT s | wall s | tokens as unchunked |")
    print("|---|---:|---:|---:|---:|---:|---|")
    ref = None
    for name, cfg in modes:
        r = run(model, drafters, cfg, short, long, args)
        ref = ref or r["tokens"]
        g = r["gaps"]
        p99 = g[min(len(g) - 1, int(0.99 * len(g)))]
        same = "identical" if r["tokens"] == ref else "DIFFERENT"
        print(
            f"| {name} | {1e3 * statistics.median(g):.0f} | {1e3 * p99:.0f} | {1e3 * g[-1]:.0f} | "
            f"{r['ttft']:.2f} | {r['wall']:.2f} | {same} |"
        )


if __name__ == "__main__":
    main()
