"""A distribution's summary: median and spread with a distribution-free 95% confidence interval of the
median. Self-contained (no torch): the one definition the record, the reports and the benchmarks use."""

from __future__ import annotations

import math


def _quantile(sorted_xs: list[float], q: float) -> float:
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def median_ci95(sorted_xs: list[float]) -> tuple[float, float]:
    """Distribution-free 95% CI of the median from order statistics (binomial, p = 1/2)."""
    n = len(sorted_xs)
    if n < 6:  # no pair of order statistics reaches 95%: report the whole range
        return sorted_xs[0], sorted_xs[-1]
    cdf, k = 0.0, 0
    # largest k with P(Bin(n, 1/2) <= k - 1) <= 0.025
    for j in range(n + 1):
        cdf += math.comb(n, j) / 2**n
        if cdf > 0.025:
            k = j
            break
    lo, hi = max(k - 1, 0), min(n - k, n - 1)
    return sorted_xs[lo], sorted_xs[hi]


def summarize(times: list[float]) -> dict:
    xs = sorted(times)
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    lo, hi = median_ci95(xs)
    return {
        "median": _quantile(xs, 0.5),
        "mean": mean,
        "p10": _quantile(xs, 0.1),
        "p90": _quantile(xs, 0.9),
        "std": std,
        "ci95_low": lo,
        "ci95_high": hi,
        "n": n,
        "min": xs[0],
        "max": xs[-1],
    }
