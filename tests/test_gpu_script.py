"""The prepared H200 script stays runnable: its --smoke mode runs every phase at toy sizes on this CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_h200_script_smoke(tmp_path):
    r = subprocess.run(
        [sys.executable, "benchmarks/gpu/h200.py", "--smoke", "--phases", "abcd", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(summary) >= {"a", "b", "c", "d"}
    assert all(v > 0 for v in summary["a"]["verify_ms"].values()) and summary["a"]["round_steps"] > 0
    assert summary["d"]["tau"] is not None and summary["d"]["tau"] >= 1.0
    for phase in "abcd":
        assert (tmp_path / f"h200-{phase}.md").is_file()


def test_h200_script_refuses_a_cpu_without_smoke():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the script would run for real")
    r = subprocess.run([sys.executable, "benchmarks/gpu/h200.py"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "no CUDA device" in r.stderr
