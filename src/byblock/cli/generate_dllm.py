"""The diffusion branch of `byblock generate`: block-wise denoising instead of token-by-token decoding."""

from __future__ import annotations

import argparse
import json
import sys

from byblock.errors import ByblockError


def add_dllm_args(parser: argparse.ArgumentParser) -> None:
    """Diffusion flags shared by `generate` and `serve`."""
    d = parser.add_argument_group("diffusion models (DiffusionGemma, byblock_dllm.json checkpoints)")
    d.add_argument(
        "--sampler",
        default=None,
        choices=["low-confidence", "threshold", "factor", "entropy", "renoise"],
        help="diffusion sampler (default: renoise for DiffusionGemma, threshold for mask models)",
    )
    d.add_argument("--steps", type=int, default=None, help="denoising steps per block (cap; exact for low-confidence)")
    d.add_argument("--threshold", type=float, default=0.9, help="threshold sampler: confidence τ")
    d.add_argument("--factor", type=float, default=1.0, help="factor sampler: f in 1 - f/(n+1)")
    d.add_argument("--entropy-bound", type=float, default=0.1, help="entropy / renoise samplers: γ")
    d.add_argument("--t-min", type=float, default=0.4, help="renoise: final temperature")
    d.add_argument("--t-max", type=float, default=0.8, help="renoise: first temperature")
    d.add_argument(
        "--cache",
        default="exact",
        choices=["exact", "none", "prefix"],
        help="exact block KV cache | recompute | Fast-dLLM prefix cache (approximate on bidirectional models)",
    )


def dllm_config(args: argparse.Namespace, loaded, max_new_tokens: int, temperature: float = 0.0, seed=None):
    """The DllmConfig the flags describe (default sampler by model family); checked against the model."""
    from byblock.dllm import CacheMode, DllmConfig, SamplerKind
    from byblock.dllm.generate import check_sampler

    default = SamplerKind.RENOISE if loaded.denoiser.mask_token_id is None else SamplerKind.THRESHOLD
    cfg = DllmConfig(
        sampler=SamplerKind(args.sampler) if args.sampler else default,
        block_size=args.block_size,
        steps=args.steps,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        threshold=args.threshold,
        factor=args.factor,
        entropy_bound=args.entropy_bound,
        t_min=args.t_min,
        t_max=args.t_max,
        cache=CacheMode(args.cache),
        seed=seed,
    )
    check_sampler(loaded.denoiser, cfg)
    return cfg


def encode_dllm_prompt(loaded, text: str, chat: bool = True) -> list[int]:
    """Prompt token ids for a diffusion checkpoint: its prompt suffix appended, then its chat template where it
    has one and `chat` (else the raw text). One-line error for an empty prompt."""
    tok = loaded.tokenizer
    text = text + loaded.meta.get("prompt_suffix", "")
    if chat and getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    else:
        ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ByblockError("the prompt is empty after tokenization")
    return ids


def run_dllm(args: argparse.Namespace) -> int:
    """Load a diffusion checkpoint, decode the prompt with the chosen sampler, print text (or --json)."""
    from byblock.dllm.generate import diffusion_generate
    from byblock.dllm.loading import load_dllm
    from byblock.models.loading import DTYPES

    if args.drafter != "none":
        raise ByblockError("--drafter is for autoregressive models; diffusion models take --sampler")
    loaded = load_dllm(args.model, dtype=DTYPES[args.dtype], device=args.device)
    max_new = args.max_new_tokens or int(loaded.meta.get("max_new_tokens", 256))
    cfg = dllm_config(args, loaded, max_new, args.temperature, args.seed)
    tok = loaded.tokenizer
    ids = encode_dllm_prompt(loaded, args.prompt, chat=not args.no_chat)
    import torch

    with torch.inference_mode():
        res = diffusion_generate(loaded.denoiser, ids, cfg, loaded.eos_token_ids)
    out_ids = [t for t in res.token_ids if t not in loaded.eos_token_ids]
    text_out = tok.decode(out_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text_out, "sampler": cfg.sampler.value, "prompt_tokens": len(ids), **res.to_json()}))
        return 0
    sys.stdout.write(text_out)
    sys.stderr.write(
        f"\n[{len(res.token_ids)} tokens, sampler {cfg.sampler.value}, {res.nfe} denoising forwards "
        f"(TPF {res.tpf:.2f}), {res.commits} block commits, {res.total_s:.3f}s, finish {res.finish_reason}]\n"
    )
    return 0
