"""Sampling and structured-output flags shared by `generate` and `bench` (vLLM's / llama.cpp's names where
they have one), and the SamplingParams they build."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from byblock.errors import ByblockError
from byblock.sampling.grammar import Grammar, GrammarKind
from byblock.sampling.params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Penalties, min-p, stop token ids, logprobs and a grammar (temperature / top-k / top-p / seed / stop are the
    command's own)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's: >1 discourages repeats")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="end at this token (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past EOS (benchmarking)")
    g.add_argument("--logprobs", type=int, default=None, metavar="K", help="return token logprobs and K alternatives")
    s = parser.add_argument_group("structured output (one of)")
    s.add_argument("--json-schema", default=None, metavar="FILE|JSON", help="output JSON matching this schema")
    s.add_argument("--json-object", action="store_true", help="output any JSON object")
    s.add_argument("--regex", default=None, help="output matching this (Rust-syntax) regular expression")
    s.add_argument("--choice", action="append", default=None, help="output exactly one of these strings (repeatable)")
    s.add_argument("--grammar", default=None, metavar="FILE", help="a Lark or GBNF grammar file")


def _grammar(args: argparse.Namespace) -> Grammar | None:
    given = [k for k in ("json_schema", "json_object", "regex", "choice", "grammar") if getattr(args, k)]
    if len(given) > 1:
        raise ByblockError(f"give one structured-output flag, not {len(given)}: {', '.join(given)}")
    if args.json_schema:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise ByblockError(f"--json-schema: {text} is neither a JSON object nor a file")
            text = path.read_text()
        return Grammar(GrammarKind.JSON_SCHEMA, text)
    if args.json_object:
        return Grammar(GrammarKind.JSON_OBJECT)
    if args.regex:
        return Grammar(GrammarKind.REGEX, args.regex)
    if args.choice:
        return Grammar(GrammarKind.CHOICE, json.dumps(args.choice))
    if args.grammar:
        path = Path(args.grammar)
        if not path.is_file():
            raise ByblockError(f"--grammar: no such file: {path}")
        return Grammar(GrammarKind.GRAMMAR, path.read_text())
    return None


def sampling_params(args: argparse.Namespace, max_new_tokens: int) -> SamplingParams:
    """The SamplingParams of the command's flags (InvalidParameterError / ByblockError on bad values)."""
    grammar = _grammar(args)
    if grammar is not None:
        grammar.check()
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop_token_ids=tuple(args.stop_token_id),
        logprobs=args.logprobs,
        grammar=grammar,
    )


def refuse_for_dllm(args: argparse.Namespace) -> None:
    """Diffusion samplers unmask many positions at once and take none of these flags: say so, never ignore."""
    defaults = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    used = [k for k, v in defaults.items() if getattr(args, k) != v]
    used += [
        k
        for k in ("stop_token_id", "ignore_eos", "logprobs", "json_schema", "json_object", "regex", "choice", "grammar")
        if getattr(args, k) not in (None, False, [])
    ]
    if getattr(args, "verify", "lossless") != "lossless":
        used.append("verify")
    if used:
        flags = ", ".join("--" + k.replace("_", "-") for k in used)
        raise ByblockError(f"{flags}: not supported by diffusion-model sampling")
