"""`byblock generate PROMPT`: stream text, then a stats line (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys

from byblock.cli import speculative_args
from byblock.cli.dtype_args import add_dtype_args, load_target, resolve_placement
from byblock.cli.sampling_args import add_sampling_args, sampling_params
from byblock.cli.sparse_args import add_sparse_args, enable_sparse
from byblock.cli.verify_args import add_verify_args, guard_config
from byblock.models.registry import DEFAULT_MODEL

DRAFT_STYLE = "\x1b[1;32m"  # accepted draft tokens: bold green
RESET = "\x1b[0m"


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `byblock generate`."""
    parser.add_argument("prompt", help="the prompt (a user turn; --no-chat sends it raw)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, checkpoint dir, .gguf or hub id")
    add_dtype_args(parser)
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="default 256 (diffusion models: their answer length if set)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument(
        "--drafter",
        default="none",
        help="none | ngram | model:ID | dflash|ddtree|domino|dominotree|hybrid|eagle3|eagle3tree[:PATH]",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per verify forward: the anchor + B-1 drafted (default 8; dflash: its trained block size)",
    )
    parser.add_argument("--num-candidates", type=int, default=1, help="ngram: continuations merged into a tree")
    parser.add_argument(
        "--tree-budget", type=int, default=31, help="max draft nodes per round (trees; 31 + root = one 32-row pass)"
    )
    parser.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix matched")
    parser.add_argument("--ngram-max", type=int, default=3, help="ngram: longest suffix matched (tried first)")
    parser.add_argument("--adaptive", action="store_true", help="dflash/ddtree: size each round from measured costs")
    parser.add_argument("--highlight", action="store_true", help="colour tokens that came from accepted drafts")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow hub checkpoints to run code")
    speculative_args.add_arg(parser)
    add_verify_args(parser)
    add_sampling_args(parser)
    add_sparse_args(parser)
    from byblock.cli.generate_dllm import add_dllm_args

    add_dllm_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load, generate, print."""
    from byblock.dllm.loading import is_dllm_checkpoint

    resolve_placement(args)

    if args.sampler is not None or is_dllm_checkpoint(args.model):
        from byblock.cli.generate_dllm import run_dllm
        from byblock.cli.sampling_args import refuse_for_dllm

        refuse_for_dllm(args)
        return run_dllm(args)
    from byblock.drafters import DrafterSpec, build_drafter
    from byblock.engine.api import stream

    params = sampling_params(args, args.max_new_tokens or 256)
    if args.verify != "lossless" and args.drafter == "none":
        from byblock.errors import InvalidParameterError

        raise InvalidParameterError("--verify specguard needs a drafter (e.g. --drafter dflash)")
    guard = guard_config(args)
    speculative_args.apply_to_generate(args)
    spec = DrafterSpec.parse(
        args.drafter,
        block_size=args.block_size,
        num_candidates=args.num_candidates,
        tree_budget=args.tree_budget,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        adaptive=args.adaptive,
    )
    model = load_target(args)
    density = enable_sparse(model, args)
    drafter = build_drafter(spec, model, dtype=args.dtype)
    gen = stream(model, args.prompt, params, drafter=drafter, chat=not args.no_chat, guard=guard)
    out = sys.stdout
    for ev in gen:
        if args.json:
            continue
        drafted = args.highlight and ev.tokens and all(t.from_draft for t in ev.tokens)
        out.write(f"{DRAFT_STYLE}{ev.text}{RESET}" if drafted else ev.text)
        out.flush()
    res = gen.result
    assert res is not None
    if args.json:
        extra = {}
        if density and density.per_layer:
            extra["stem_density"] = {str(k): round(v, 4) for k, v in sorted(density.per_layer.items())}
        if density and density.decode:  # the last decode forward's share of visible keys read, per layer
            extra["decode_density"] = {str(k): round(v, 4) for k, v in sorted(density.decode.items())}
        print(json.dumps({**res.to_json(), **extra}))
        return 0
    spec_part = ""
    if res.drafter != "none":
        spec_part = f", drafter {res.drafter}, τ {res.stats.mean_accepted:.2f} over {res.stats.rounds} rounds"
        if guard is not None:
            spec_part += f", specguard kept {res.stats.guard_tokens} tokens lossless verification would not"
    sys.stderr.write(
        f"\n[{res.num_new_tokens} new tokens, ttft {res.ttft_s:.3f}s, {res.tokens_per_s:.1f} tok/s, "
        f"finish {res.finish_reason.value}{spec_part}]\n"
    )
    return 0
