"""Run several `byblock` CLI invocations at once: each spends most of its time importing torch and transformers
(~4-5 s here), so on a 2-core machine running them concurrently roughly halves a CLI test's wall time."""

from __future__ import annotations

import subprocess


def run_all(cmds: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """Start every command, then wait for each; results in the order given (text stdout/stderr)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    out = []
    for cmd, p in zip(cmds, procs, strict=True):
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return out
