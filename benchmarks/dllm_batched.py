"""The batched diffusion engine against the FIFO one, in-process: held-out Sudoku puzzles on the shipped mask
model, all submitted at once; aggregate tokens/s, forwards, accuracy, and whether every answer equals FIFO's.

    python benchmarks/dllm_batched.py --puzzles 32 --max-num-seqs 1,4,16
"""

from __future__ import annotations

import argparse
import time

from byblock.bench.dllm import load_puzzles
from byblock.bench.hardware import describe_machine
from byblock.dllm import DllmConfig, SamplerKind
from byblock.dllm.loading import load_dllm, resolve_dllm
from byblock.dllm.sudoku import Board, is_solution, puzzle_prompt
from byblock.engine.core import EngineRequest
from byblock.engine.dllm_batched import DllmBatchedEngineCore, prepare_for_batching
from byblock.engine.dllm_core import DllmEngineCore
from byblock.engine.scheduler import BatchConfig
from byblock.sampling.params import SamplingParams


def drain(core, requests: list[EngineRequest]) -> tuple[dict, float, int]:
    """Submit every request, step until done: ({id: result}, seconds, engine steps)."""
    for r in requests:
        core.add_request(r)
    results, steps, t0 = {}, 0, time.perf_counter()
    while core.has_unfinished():
        for out in core.step():
            if out.error is not None:
                raise SystemExit(f"error: {out.error}")
            if out.result is not None:
                results[out.request_id] = out.result
        steps += 1
    return results, time.perf_counter() - t0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="sudoku6-mdm")
    ap.add_argument("--puzzles", type=int, default=32)
    ap.add_argument("--max-num-seqs", default="1,4,16")
    ap.add_argument("--threshold", type=float, default=0.9)
    args = ap.parse_args()
    loaded = load_dllm(args.model)
    prepare_for_batching(loaded.denoiser)  # both engines on the same kernels: the answers must be equal
    tok = loaded.tokenizer
    puzzles = load_puzzles(resolve_dllm(args.model) / "test_puzzles.jsonl", args.puzzles)
    cells = int(loaded.meta.get("block_size", 36))
    params = SamplingParams(max_new_tokens=cells)
    requests = [EngineRequest(f"p{i}", tuple(puzzle_prompt(tok, p)), params) for i, (p, _) in enumerate(puzzles)]
    base = DllmConfig(sampler=SamplerKind.THRESHOLD, threshold=args.threshold)
    eos = loaded.eos_token_ids
    drain(DllmEngineCore(loaded.denoiser, tok, eos, base), requests[:2])  # warm-up
    board = Board(*loaded.meta.get("board", (2, 3)))
    print(describe_machine())
    print(f"model {args.model}: {len(puzzles)} held-out puzzles submitted at once, threshold {args.threshold}\n")
    print("| engine | max seqs | tok/s | vs FIFO | engine steps | forwards per token | solved | answers as FIFO |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    runs = [("fifo", 1, DllmEngineCore(loaded.denoiser, tok, eos, base))]
    for n in (int(x) for x in args.max_num_seqs.split(",")):
        runs.append(("batched", n, DllmBatchedEngineCore(loaded.denoiser, tok, eos, base, BatchConfig(max_num_seqs=n))))
    ref, ref_tps = None, 0.0
    for name, n, core in runs:
        results, secs, steps = drain(core, requests)
        tokens = sum(len(r.token_ids) for r in results.values())
        forwards = sum(r.stats.rounds for r in results.values())
        answers = {rid: r.token_ids for rid, r in results.items()}
        ref = ref or answers
        ref_tps = ref_tps or tokens / secs
        solved = 0
        for i, (p, _) in enumerate(puzzles):
            solved += is_solution(board, p, tok.decode(results[f"p{i}"].token_ids))
        same = "identical" if answers == ref else "DIFFERENT"
        print(
            f"| {name} | {n} | {tokens / secs:.0f} | {tokens / secs / ref_tps:.2f}× | {steps} | "
            f"{forwards / tokens:.3f} | {solved}/{len(puzzles)} | {same} |"
        )


if __name__ == "__main__":
    main()
