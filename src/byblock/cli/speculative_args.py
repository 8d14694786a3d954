"""`--speculative-config JSON` (vLLM's flag) on generate / serve / bench, mapped onto the commands' own drafter
flags (drafters/spec_config.py says how, and how drafted tokens are counted)."""

from __future__ import annotations

import argparse

from byblock.drafters.spec_config import SpeculativeConfig
from byblock.errors import ByblockError

HELP = (
    'vLLM\'s form, e.g. \'{"method": "dflash", "num_speculative_tokens": 15}\' (methods: ngram, draft_model, '
    "dflash, ddtree, hybrid, domino, dominotree); num_speculative_tokens counts drafted tokens = --block-size - 1"
)


def add_arg(parser: argparse.ArgumentParser) -> None:
    """The flag."""
    parser.add_argument("--speculative-config", default=None, metavar="JSON", help=HELP)


def _knob_conflicts(args: argparse.Namespace, cfg: SpeculativeConfig) -> None:
    flags = {
        "block_size": "--block-size",
        "tree_budget": "--tree-budget",
        "num_candidates": "--num-candidates",
        "ngram_max": "--ngram-max",
        "ngram_min": "--ngram-min",
    }
    defaults = {"block_size": None, "tree_budget": 31, "num_candidates": 1, "ngram_max": 3, "ngram_min": 1}
    for key, value in cfg.knobs().items():
        given = getattr(args, key, defaults[key])
        if given != defaults[key] and given != value:
            raise ByblockError(f"--speculative-config sets {key} = {value} but {flags[key]} says {given}")
        setattr(args, key, value)


def apply_to_generate(args: argparse.Namespace) -> None:
    """Replace --drafter and its knobs by the config's (a conflicting explicit flag is an error)."""
    if args.speculative_config is None:
        return
    cfg = SpeculativeConfig.parse(args.speculative_config)
    if args.drafter != "none":
        raise ByblockError("give --drafter or --speculative-config, not both")
    if cfg.adaptive:
        args.adaptive = True
    args.drafter = cfg.drafter.removeprefix("adaptive-")
    _knob_conflicts(args, cfg)


def apply_to_serve(args: argparse.Namespace) -> None:
    """The config's drafter becomes the first (default) --drafter."""
    if args.speculative_config is None:
        return
    cfg = SpeculativeConfig.parse(args.speculative_config)
    args.drafter = [cfg.drafter, *args.drafter]
    _knob_conflicts(args, cfg)


def bench_method(text: str) -> str:
    """The bench method the config names."""
    cfg = SpeculativeConfig.parse(text)
    if cfg.prompt_lookup_max is not None or cfg.prompt_lookup_min is not None or cfg.num_candidates is not None:
        raise ByblockError("bench --speculative-config: prompt_lookup_* / num_candidates are not bench knobs")
    return cfg.bench_method()
