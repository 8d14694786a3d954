"""An AR model converted to block diffusion (`byblock train convert`): tokens per forward vs quality, per sampler,
beside the AR model it came from.

    .venv/bin/python benchmarks/convert_dllm.py --dllm runs/convert/export-dllm [--model smollm2-135m]
        [--limit 16] [--max-new-tokens 64] [--update-results benchmarks/RESULTS.md --section convert-dllm]

Quality is agreement with the AR model's own greedy answer (the model the conversion started from, and whose
answers it was trained on): the share of the AR answer's positions the diffusion answer reproduces, and the
mean length of the exactly shared prefix. Rows: the AR model (1 token per forward by definition), the AR
weights decoded as a dLLM before any fine-tune (the control: what the conversion itself bought), and the
converted model under each sampler. Prompts: the packaged dev set (chat template), greedy everywhere.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path

SAMPLERS = (
    ("low-confidence, 1 token/step", dict(sampler="low-confidence", steps=None)),
    ("low-confidence, 2 tokens/step", dict(sampler="low-confidence", steps=-2)),
    ("threshold 0.9", dict(sampler="threshold", threshold=0.9)),
    ("threshold 0.7", dict(sampler="threshold", threshold=0.7)),
    ("factor 1.0", dict(sampler="factor", factor=1.0)),
    ("entropy bound 0.1", dict(sampler="entropy", entropy_bound=0.1)),
)


def agreement(got: list[int], ref: list[int]) -> tuple[float, int]:
    """(share of ref's positions reproduced, length of the exactly shared prefix)."""
    same = sum(a == b for a, b in zip(got, ref, strict=False))
    prefix = 0
    for a, b in zip(got, ref, strict=False):
        if a != b:
            break
        prefix += 1
    return same / max(len(ref), 1), prefix


def dllm_rows(denoiser, prompts: list[list[int]], refs: list[list[int]], eos, args, label: str) -> list[dict]:
    """One row per sampler for one denoiser."""
    from byblock.dllm.config import DllmConfig, SamplerKind
    from byblock.dllm.generate import diffusion_generate

    block = denoiser.default_block_size
    rows = []
    for name, knobs in SAMPLERS:
        knobs = dict(knobs)
        kind = SamplerKind(knobs.pop("sampler"))
        steps = knobs.pop("steps", None)
        if steps is not None and steps < 0:  # -n: n tokens per step
            steps = max(1, block // -steps)
        elif kind is SamplerKind.LOW_CONFIDENCE:
            steps = block
        cfg = DllmConfig(sampler=kind, steps=steps, max_new_tokens=args.max_new_tokens, **knobs)
        agree, prefix, nfe, toks, secs = [], [], 0, 0, 0.0
        for ids, ref in zip(prompts, refs, strict=True):
            t0 = time.perf_counter()
            res = diffusion_generate(denoiser, ids, cfg, eos)
            secs += time.perf_counter() - t0
            a, p = agreement(res.token_ids, ref)
            agree.append(a)
            prefix.append(p)
            nfe += res.nfe
            toks += len(res.token_ids)
        rows.append(
            {"model": label, "sampler": name, "tpf": toks / max(nfe, 1), "agreement": sum(agree) / len(agree),
             "prefix": sum(prefix) / len(prefix), "tok_s": toks / secs}
        )  # fmt: skip
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> int:
    """Measure and print the table (optionally into RESULTS.md)."""
    import torch

    from byblock.bench.datasets import load_dev
    from byblock.dllm.denoisers import MaskDenoiser
    from byblock.dllm.loading import load_dllm
    from byblock.engine.api import generate
    from byblock.models.loading import load_model
    from byblock.sampling.params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dllm", required=True, help="the converted checkpoint (OUT/export-dllm)")
    p.add_argument("--model", default="smollm2-135m", help="the AR model it was converted from")
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--no-control", action="store_true", help="skip the unconverted-weights rows")
    p.add_argument("--update-results", default=None)
    p.add_argument("--section", default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ar = load_model(args.model, dtype="float32")
    prompts = [ar.encode_prompt(pr.text, chat=True) for pr in load_dev(limit=args.limit)]
    refs, t0, toks = [], time.perf_counter(), 0
    for ids in prompts:
        res = generate(ar, ids, SamplingParams(max_new_tokens=args.max_new_tokens), chat=False)
        refs.append(res.token_ids)
        toks += len(res.token_ids)
    rows = [{"model": "AR", "sampler": "greedy (plain decoding)", "tpf": 1.0, "agreement": 1.0,
             "prefix": sum(map(len, refs)) / len(refs), "tok_s": toks / (time.perf_counter() - t0)}]  # fmt: skip
    loaded = load_dllm(args.dllm)
    if not args.no_control:  # the same AR weights as a shifted block-causal dLLM, before any fine-tune
        from transformers import AutoModelForCausalLM

        from byblock.models.loading import resolve_checkpoint

        hf = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(args.model), dtype=torch.float32)
        base = MaskDenoiser(hf, loaded.denoiser.mask_token_id, loaded.denoiser.default_block_size, shift=True)
        rows += dllm_rows(base, prompts, refs, loaded.eos_token_ids, args, "AR weights, not converted")
    rows += dllm_rows(loaded.denoiser, prompts, refs, loaded.eos_token_ids, args, "converted")
    meta = loaded.meta
    head = (
        f"`{args.model}` converted for {meta.get('steps')} steps ({meta.get('train_hours')} CPU-hours, block "
        f"{meta.get('block_size')}); {len(prompts)} dev prompts, {args.max_new_tokens} new tokens, greedy, fp32, "
        "exact block KV cache. Agreement: share of the AR greedy answer's positions reproduced; prefix: mean "
        "length of the exactly shared start."
    )
    lines = [
        head,
        "",
        "| model | sampler | tokens / forward | agreement | shared prefix | tok/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['sampler']} | {r['tpf']:.2f} | {r['agreement']:.1%} | {r['prefix']:.1f} | "
            f"{r['tok_s']:.1f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.update_results:
        from byblock.bench.report import replace_section

        cmd = "python benchmarks/convert_dllm.py " + shlex.join(sys.argv[1:])
        replace_section(
            Path(args.update_results), args.section, f"Measured {datetime.date.today()}, `{cmd}`.\n\n{table}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
