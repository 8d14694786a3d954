"""Target forward cost, transformers' cache and SDPA backend vs byblock's (kv/kv_buffer.py, gqa_sdpa.py).

Two copies of the same model in one process: "old" appends K/V by concatenation (DynamicLayer) and attends with
transformers' `sdpa` backend (repeat_kv under a mask); "new" is what load_model gives (preallocated buffer, GQA
SDPA). For each cached context and block size k, forwards alternate between the two (order flipped every
repetition, so drift hits both alike); medians, their ratio, and whether the logits are bitwise equal.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/kv_buffer_ab.py --contexts 300 1000 --blocks 1 9 17 32

`--methods ar,dflash@16,ddtree@31 --prompts 8` also decodes dev prompts end to end with both (greedy, 128 new
tokens, old and new alternating per prompt): tokens/s of each and whether the answers are identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.cache_utils import DynamicLayer

from byblock import SamplingParams, load_model
from byblock.bench.datasets import load_dev
from byblock.bench.hardware import describe_machine
from byblock.bench.methods import MethodRunner, MethodSpec
from byblock.kv.kv_cache import KVCache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 9, 17, 32])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--methods", default="", help="comma-separated bench methods to also run end to end")
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    new = load_model(args.model, dtype="float32")
    old = load_model(args.model, dtype="float32")
    old.hf.set_attn_implementation("sdpa")

    def legacy_cache() -> KVCache:
        cache = KVCache()
        cache.hf.layer_class_to_replicate = DynamicLayer
        return cache

    old.new_cache = legacy_cache  # every cache the engine makes for `old` concatenates, as before
    models = {"old": old, "new": new}
    print(f"machine: {describe_machine()}; torch threads {torch.get_num_threads()}")
    print("| cached | k | old ms | new ms | new/old | logits bitwise equal |")
    print("|---:|---:|---:|---:|---:|:---:|")
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        prompt = torch.randint(100, 10000, (1, ctx), generator=g)
        caches = {}
        for name, m in models.items():
            caches[name] = m.new_cache()
            if name == "old":
                caches[name].hf.layer_class_to_replicate = DynamicLayer
            m.forward(prompt, caches[name], logits_to_keep=1)
        for k in args.blocks:
            block = torch.randint(100, 10000, (1, k), generator=g)
            times: dict[str, list[float]] = {"old": [], "new": []}
            logits = {}
            for rep in range(args.reps):
                for name in ("old", "new") if rep % 2 else ("new", "old"):
                    t0 = time.perf_counter()
                    logits[name] = models[name].forward(block, caches[name], logits_to_keep=k).logits
                    times[name].append(time.perf_counter() - t0)
                    caches[name].crop(ctx)
            a, b = (statistics.median(times[n]) * 1e3 for n in ("old", "new"))
            same = torch.equal(logits["old"], logits["new"])
            print(f"| {ctx} | {k} | {a:.1f} | {b:.1f} | {b / a:.3f} | {'yes' if same else 'NO'} |", flush=True)
    if args.methods:
        end_to_end(models, args.methods.split(","), args.prompts)


def end_to_end(models: dict, methods: list[str], n_prompts: int) -> None:
    """Decode dev prompts with each method on both models, alternating per prompt."""
    prompts = [models["new"].encode_prompt(p.text, chat=p.chat) for p in load_dev(n_prompts)]
    params = SamplingParams(max_new_tokens=128)
    print("\n| method | old tok/s | new tok/s | new/old time per token | answers identical |")
    print("|---|---:|---:|---:|:---:|")
    for method in methods:
        spec = MethodSpec.parse(method)
        runners = {name: MethodRunner(spec, m, None, "float32") for name, m in models.items()}
        tokens = {"old": 0, "new": 0}
        seconds = {"old": 0.0, "new": 0.0}
        same = 0
        for i, ids in enumerate(prompts):
            answers = {}
            for name in ("old", "new") if i % 2 else ("new", "old"):
                res = runners[name].run(ids, params)
                answers[name] = res.token_ids
                tokens[name] += len(res.token_ids)
                seconds[name] += res.total_s
            same += answers["old"] == answers["new"]
        rate = {n: tokens[n] / seconds[n] for n in tokens}
        ratio = rate["old"] / rate["new"]
        print(f"| {method} | {rate['old']:.2f} | {rate['new']:.2f} | {ratio:.3f} | {same}/{len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
