"""`byblock recommend --model DIFFUSION_CHECKPOINT`: the sampler sweep (bench/recommend_dllm.py), printed."""

from __future__ import annotations

import argparse
import json
import sys

from byblock.errors import ByblockError


def _prompts(args: argparse.Namespace, loaded) -> tuple[list[list[int]], object]:
    """(prompt token ids, check(i, token_ids) -> solved, or None). Puzzle checkpoints default to the held-out
    puzzles they ship; otherwise --prompts, through the chat template like `byblock generate`."""
    from byblock.cli.bench import load_datasets
    from byblock.cli.generate_dllm import encode_dllm_prompt
    from byblock.dllm.loading import resolve_dllm

    shipped = resolve_dllm(args.model) / "test_puzzles.jsonl"
    if loaded.meta.get("task") == "sudoku" and args.prompts == "dev" and shipped.is_file():
        from byblock.bench.dllm import load_puzzles
        from byblock.dllm.sudoku import Board, is_solution, puzzle_prompt

        puzzles = load_puzzles(shipped, args.limit)
        board = Board(*loaded.meta.get("board", (2, 3)))
        tok = loaded.tokenizer
        return [puzzle_prompt(tok, p) for p, _ in puzzles], lambda i, ids: is_solution(
            board, puzzles[i][0], tok.decode(ids)
        )
    prompts = [p for ps in load_datasets(args.prompts, None, args.limit).values() for p in ps]
    return [encode_dllm_prompt(loaded, p.text, chat=p.chat) for p in prompts], None


def run_dllm(args: argparse.Namespace) -> int:
    """Sweep the sampler settings of a diffusion checkpoint, rank them within the quality budget, print."""
    from byblock.bench.recommend_dllm import dllm_candidates, dllm_commands, dllm_table, rank_dllm, sweep_dllm
    from byblock.dllm.config import DllmConfig
    from byblock.dllm.loading import load_dllm
    from byblock.models.loading import DTYPES

    if args.methods:
        raise ByblockError("--methods lists autoregressive methods; a diffusion model's sweep is its samplers")
    if args.target == "throughput":
        raise ByblockError("recommend measures diffusion models one request at a time (--target latency)")
    dtype = "float32" if args.dtype == "auto" else args.dtype
    loaded = load_dllm(args.model, dtype=DTYPES[dtype], device=args.device)
    prompts, check = _prompts(args, loaded)
    mask_model = loaded.denoiser.mask_token_id is not None
    block = int(loaded.meta.get("block_size", 0) or getattr(loaded.denoiser, "block_size", 0) or 32)
    max_new = int(loaded.meta.get("max_new_tokens", args.max_new_tokens)) if check else args.max_new_tokens
    methods = dllm_candidates(mask_model, block, DllmConfig(max_new_tokens=max_new))
    sys.stderr.write(f"byblock recommend: {len(methods)} samplers x {len(prompts)} prompts (diffusion) ...\n")

    def progress(name: str, row: dict) -> None:
        sys.stderr.write(f"[{name}] {row['tokens'] / max(row['seconds'], 1e-9):.1f} tok/s\n")

    ranked = rank_dllm(sweep_dllm(loaded, prompts, methods, check, progress), args.max_quality_drop)
    reference = methods[0].name
    best = ranked[0]
    cmds = dllm_commands(best.method, args.model)
    if args.json:
        out = {
            "model": args.model,
            "kind": "diffusion",
            "prompts": len(prompts),
            "reference": reference,
            "ranked": [r.__dict__ for r in ranked],
            "best": best.method,
            "commands": cmds,
        }
        print(json.dumps(out))
        return 0
    quality = "puzzles solved" if check else f"agreement with {reference}"
    print(
        f"model {args.model} (diffusion), {len(prompts)} prompts, {max_new} new tokens; quality budget: "
        f"{args.max_quality_drop:.0%} of {quality}\n"
    )
    print(dllm_table(ranked, reference))
    print(f"\nbest: {best.method} ({best.tok_s:.1f} tok/s, TPF {best.tpf:.2f})")
    for what, cmd in cmds.items():
        print(f"  {what:8s} {cmd}")
    return 0
