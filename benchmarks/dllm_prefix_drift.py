"""Drift of Fast-dLLM's approximate prefix cache on a fully bidirectional mask model: how often its tokens
differ from exact recomputation, per sampler.

    .venv/bin/python benchmarks/dllm_prefix_drift.py [--update-results benchmarks/RESULTS.md --section dllm-drift]

The model is a seeded random tiny llama (tests/tiny.py) used LLaDA-style (every position attends to every
other); byblock ships no trained fully-bidirectional model yet, so this measures the mechanism, not a quality
number for a real model.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    """Token agreement prefix-cache vs exact for 20 prompts × each mask sampler."""
    from tiny import make_hf_model

    from byblock.dllm import CacheMode, DllmConfig, SamplerKind
    from byblock.dllm.denoisers import MaskDenoiser
    from byblock.dllm.generate import diffusion_generate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default=None)
    args = p.parse_args()
    model = MaskDenoiser(make_hf_model("llama"), mask_token_id=319, block_size=8, full_bidirectional=True)
    lines = ["| sampler | token agreement with exact | requests identical |", "|---|---:|---:|"]
    for sampler in (SamplerKind.LOW_CONFIDENCE, SamplerKind.THRESHOLD, SamplerKind.FACTOR, SamplerKind.ENTROPY):
        same_tokens = total = same_requests = 0
        for i in range(20):
            prompt = [5 + i, 9, 17 + 2 * i, 33, 2, 8 + i]
            runs = []
            for cache in (CacheMode.NONE, CacheMode.PREFIX):
                cfg = DllmConfig(
                    sampler=sampler, max_new_tokens=24, threshold=0.5, entropy_bound=0.5, seed=i, cache=cache
                )
                runs.append(diffusion_generate(model, prompt, cfg).token_ids)
            same_tokens += sum(a == b for a, b in zip(*runs, strict=True))
            total += len(runs[0])
            same_requests += runs[0] == runs[1]
        lines.append(f"| {sampler.value} | {same_tokens / total:.1%} | {same_requests}/20 |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.update_results:
        from byblock.bench.report import replace_section

        cmd = "python benchmarks/dllm_prefix_drift.py " + shlex.join(sys.argv[1:])
        replace_section(
            Path(args.update_results), args.section, f"Measured {datetime.date.today()}, `{cmd}`.\n\n{table}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
