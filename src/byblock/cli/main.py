"""`byblock` command line: one module per subcommand, imported only when that subcommand runs."""

from __future__ import annotations

import argparse
import importlib
import sys

from byblock import __version__

SUBCOMMANDS = {
    "generate": "Generate text from a prompt (plain or block-speculative decoding).",
    "models": "List the built-in models and whether they are installed.",
    "bench": "Benchmark decoding methods side by side (speed, τ, lossless check, reports).",
    "train": "Train a drafter for a target: regenerate data, train, export (resumable).",
    "serve": "Serve the OpenAI API with block-parallel decoding, /metrics and a playground page.",
    "loadgen": "Closed-loop load against a running server: throughput and TTFT p50/p99 per level.",
    "export": "Write a drafter in the layout a serving engine (vLLM) loads as is.",
    "recommend": "Measure the decoding methods on your prompts and print them ranked, with the winner's commands.",
    "launch": "Start a production engine's OpenAI server (vLLM) with byblock's drafter, in one command.",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad flags as a single line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s module is imported to add its flags (None: names only).

    `byblock --help` and `byblock --version` therefore import no subcommand module, hence no torch.
    """
    parser = OneLineParser(prog="byblock", description="Block-parallel LLM decoding, lossless.")
    parser.add_argument("--version", action="version", version=f"byblock {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, help_text in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(f"byblock.cli.{name}").add_args(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand argv names: its first positional argument (top-level flags take no values)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `byblock` console script."""
    from byblock.errors import ByblockError

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(f"byblock.cli.{args.command}")
    try:
        return int(module.run(args) or 0)
    except ByblockError as e:
        sys.stderr.write(f"byblock {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
