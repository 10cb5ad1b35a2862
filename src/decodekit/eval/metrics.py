"""Evaluation statistics: Wilson score interval, AUROC, reliability bins (numpy only)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson (1927) score interval for a binomial proportion; (0, 1) when n == 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at p = 0 or 1 the bound at that end is exactly 0 or 1 (centre - half would round to ~1e-17)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve of ``scores`` for predicting ``labels`` (True = positive).

    The Mann-Whitney statistic with average ranks for ties: P(score_pos > score_neg) + ½ P(tie).
    None when one class is empty.
    """
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=float)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over runs of equal scores
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def reliability_bins(confidence: Sequence[float], labels: Sequence[bool], bins: int = 10) -> list[dict[str, float]]:
    """Equal-width confidence bins over [0, 1]: count, mean confidence and accuracy of each non-empty bin."""
    c = np.clip(np.asarray(confidence, dtype=float), 0.0, 1.0)
    y = np.asarray(labels, dtype=float)
    index = np.minimum((c * bins).astype(int), bins - 1)
    out = []
    for b in range(bins):
        mask = index == b
        if mask.any():
            out.append({"lo": b / bins, "hi": (b + 1) / bins, "count": int(mask.sum()),
                        "confidence": float(c[mask].mean()), "accuracy": float(y[mask].mean())})
    return out
