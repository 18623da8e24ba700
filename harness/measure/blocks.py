"""Two runs' step times set against each other where they were measured in blocks: launches in alternating
rounds (`harness compare --rounds N`) or turns of a few steps that alternate between runs kept alive side by
side (`--interleave K`). Self-contained (no torch, no scipy), called by measure.stats.ratio_interval.

Why blocks and not steps. The steps of one launch share that launch's load: on a machine other work loads,
a launch that met a busy minute is slower in every one of its steps. A rank interval over pooled steps
then treats 40 steps as 40 independent draws when they are one draw of the load, and two identical runs
whose rounds met different load were called "slower 1.243x [1.185, 1.296]" (3 rounds at load 14-21).
The unit of replication is the block: the steps each run measured in one round, or in one turn, close
together in time, so that a load both saw cancels in their ratio. So:

- per block j: d_j, the Hodges-Lehmann log ratio of run a's steps in that block to run b's (for one step
  each, their log ratio), and where each run has at least 2 steps there, v_j, its within-block variance
  (from its Mann-Whitney interval's width and coverage, read as a normal interval);
- across the R blocks, with R large enough (6 at 95%): the order-statistic interval of the median of the
  d_j (the sign test's: exact coverage 1 - 2 P(Bin(R, 1/2) <= k - 1), assuming only that blocks are
  independent and d_j continuous; no distribution, so a block that met a burst of load moves it by one
  rank, not by its size);
- with fewer blocks (2 to 5 rounds, where no order-statistic pair reaches 95%): Student's t on the mean of
  the d_j with R - 1 degrees of freedom, its variance the larger of the blocks' spread s^2 / R and the mean
  within-block variance / R (a floor: rounds that happen to agree by chance do not make an interval
  narrower than each round's own sampling noise; Knapp-Hartung's ad hoc correction in meta-analysis).
  Its coverage is nominal (exact where the d_j are normal), and it is marked so (exact False);
- one block (one launch per run): no replication of the load, the pooled rank interval of stats, which
  the comparison widens by the load drift it measured.

Not distinguishable means within the stated equivalence margin (stats.RESOLUTION, 10% either way): the
whole interval, at its stated coverage, lies within [1/1.1, 1.1]; an interval too wide for that that
holds 1 is undecided, with the blocks that the observed spread would need.
"""

from __future__ import annotations

import math
from statistics import NormalDist

SIMPSON = 2000  # intervals of the t density's numerical integral: |error| < 1e-9 in the CDF for df >= 1


def t_cdf(x: float, df: int) -> float:
    """Student's t distribution function at x with df degrees of freedom (Simpson's rule on its density)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    if df == 1:
        return 0.5 + math.atan(x) / math.pi
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def f(t: float) -> float:
        return c * (1 + t * t / df) ** (-(df + 1) / 2)

    h = x / SIMPSON
    total = f(0.0) + f(x) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, SIMPSON))
    return 0.5 + total * h / 3


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with df degrees of freedom (bisection on t_cdf)."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _within(stratum, level: float, interval_of) -> tuple[float, float | None]:
    """(d_j, v_j): the block's log ratio and its within-block variance (None where a run has one step)."""
    r = interval_of([stratum], level)
    xs, ys = stratum
    if len(xs) < 2 or len(ys) < 2 or not 0 < r["coverage"] < 1 or r["high"] <= r["low"]:
        return math.log(r["ratio"]), None
    z = NormalDist().inv_cdf(0.5 + r["coverage"] / 2)
    return math.log(r["ratio"]), (math.log(r["high"] / r["low"]) / (2 * z)) ** 2


def blocked_interval(strata, level: float, interval_of, median_interval) -> dict:
    """The ratio interval across blocks (module docstring): {ratio, low, high, coverage, exact, method,
    n_a, n_b, rounds, block_ratios}; `strata` are (a's log times, b's log times) per block; interval_of and
    median_interval are measure.stats' (passed in: stats calls this module)."""
    per = [_within(s, level, interval_of) for s in strata]
    d = [x for x, _ in per]
    r = len(d)
    out = {
        "n_a": sum(len(x) for x, _ in strata),
        "n_b": sum(len(y) for _, y in strata),
        "rounds": r,
        "block_ratios": [math.exp(x) for x in d],
    }
    lo, hi, cov = median_interval(sorted(d), level)
    if cov >= level:  # enough blocks for a distribution-free interval on their median
        mid = sorted(d)
        med = (mid[(r - 1) // 2] + mid[r // 2]) / 2
        return {
            **out,
            "ratio": math.exp(med),
            "low": math.exp(lo),
            "high": math.exp(hi),
            "coverage": cov,
            "exact": True,
            "method": "sign",
        }
    mean = sum(d) / r
    spread = sum((x - mean) ** 2 for x in d) / (r - 1)
    within = [v for _, v in per if v is not None]
    floor = sum(within) / len(within) if within else 0.0
    half = t_quantile(0.5 + level / 2, r - 1) * math.sqrt(max(spread, floor) / r)
    return {
        **out,
        "ratio": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
        "coverage": level,
        "exact": False,
        "method": "t",
        "floored": floor > spread,
    }


def blocks_needed(d: dict, level: float, resolution: float) -> int | None:
    """The blocks at which an interval of the observed spread would decide (exclude 1, or fit the margin
    around an estimate that stays where it is): it narrows as 1 / sqrt(R)."""
    est, low, high, r = d["ratio"], d["low"], d["high"], d["rounds"]
    half = max(math.log(high / est), math.log(est / low), 1e-12)
    e = abs(math.log(est))
    target = max(e, math.log1p(resolution) - e)
    if target <= 0:
        return None
    return max(r + 1, 6, math.ceil(r * (half / target) ** 2))  # 6: the fewest blocks for the sign interval
