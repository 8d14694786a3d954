"""`--verify lossless|specguard` and SpecGuard's thresholds (generate, bench)."""

from __future__ import annotations

import argparse
import sys

WARNING = (
    "warning: --verify specguard is NOT lossless: it keeps drafted reasoning steps the target finds plausible, "
    "even where the target would have written something else\n"
)


def add_verify_args(parser: argparse.ArgumentParser) -> None:
    """The verification flags."""
    g = parser.add_argument_group("verification")
    g.add_argument(
        "--verify",
        default="lossless",
        choices=["lossless", "specguard"],
        help="lossless (default): the output is the target's own; specguard: step-level acceptance of drafted "
        "chains (SpecGuard, lossy, opt-in)",
    )
    g.add_argument("--specguard-min-logprob", type=float, default=-1.0, help="specguard: a step's mean log p floor")
    g.add_argument(
        "--specguard-min-token-logprob", type=float, default=-6.0, help="specguard: no token of a step below this"
    )
    g.add_argument(
        "--specguard-min-agreement", type=float, default=0.6, help="specguard: share of a step's tokens = target top-1"
    )


def guard_config(args: argparse.Namespace, warn: bool = True):
    """The SpecGuardConfig the flags ask for (None: lossless); warns on stderr that it is lossy."""
    if args.verify != "specguard":
        return None
    from byblock.verify.specguard import SpecGuardConfig

    cfg = SpecGuardConfig(
        min_mean_logprob=args.specguard_min_logprob,
        min_token_logprob=args.specguard_min_token_logprob,
        min_agreement=args.specguard_min_agreement,
    )
    if warn:
        sys.stderr.write(WARNING)
    return cfg
