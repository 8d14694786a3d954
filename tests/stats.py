"""A chi-square goodness-of-fit test (no scipy needed)."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_pvalue(samples: list[tuple[int, ...]], expected: dict[tuple[int, ...], float]) -> float:
    """P-value of observing `samples` if outcomes follow `expected` (probabilities summing to ~1).

    Cells with expected probability 0 that are observed make the p-value 0 (impossible outcome).
    Cells are merged so each has an expected count >= 5 (the usual validity condition).
    """
    n = len(samples)
    counts = Counter(samples)
    if any(expected.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0
    cells = sorted(expected.items(), key=lambda kv: kv[1])
    obs: list[float] = []
    exp: list[float] = []
    acc_o = acc_e = 0.0
    for key, prob in cells:
        acc_o += counts.get(key, 0)
        acc_e += prob * n
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0 and exp:
        obs[-1] += acc_o
        exp[-1] += acc_e
    if len(exp) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0)))
