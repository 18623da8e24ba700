"""A distribution's summary, and two runs' step times set against each other. Self-contained (no torch,
no scipy): the one definition the record, the reports and the benchmarks use.

- The median's interval is a pair of order statistics (distribution-free: binomial, p = 1/2) that
  states its exact coverage: the narrowest symmetric pair covering at least 95%, which at n = 8 is the
  range (99.2%) and below 6 steps is the range at less than 95% (n = 5: 93.75%), said so.
- Two runs are compared by an interval on the ratio of their step times, never by overlapping
  intervals: the Hodges-Lehmann estimate of the shift between the runs' log step times (the median
  of every pairwise log ratio) with its distribution-free interval from the Mann-Whitney null
  distribution, exact for m x n <= EXACT_PAIRS (a normal approximation above). Why this and not a
  bootstrap: step times are a handful of skewed, positive values whose noise (load) acts by a factor;
  on log times a factor is a shift, the rank interval needs no distribution and its coverage is
  exact at n = 8 where a bootstrap's percentile interval under-covers and states no coverage.
- That rank interval treats the steps as independent draws, which the steps of one launch are not on a
  loaded machine (they share its load): runs measured in blocks (rounds of launches, interleaved turns)
  are compared block by block instead, the block the unit of replication (measure.blocks, which argues
  it); one launch per run keeps the rank interval, which the comparison widens by its measured drift.
- The verdict: "faster"/"slower" where the interval excludes 1; "not distinguishable" where it holds 1
  and lies within RESOLUTION either way (the stated equivalence margin: any difference is smaller); else
  "undecided", with the steps per run (or the blocks) that the observed spread would need to decide (the
  interval narrows as 1 / sqrt(n)).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

LEVEL = 0.95  # the confidence every interval is built for (each states the coverage it has)
RESOLUTION = 0.10  # a ratio within 10% of 1 either way: "not distinguishable" when the interval fits inside
EXACT_PAIRS = 4000  # the Mann-Whitney null distribution exactly up to m x n pairs (DP: m x mn steps)


def _quantile(sorted_xs: list[float], q: float) -> float:
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _binom_tail(n: int, k: int) -> float:
    """P(Bin(n, 1/2) <= k)."""
    return sum(math.comb(n, j) for j in range(k + 1)) / 2**n


def _median_k(n: int, level: float) -> int:
    """The largest k whose pair x(k), x(n+1-k) covers the median with probability 1 - 2 P(Bin(n, 1/2) <= k - 1)
    >= level; 1 (the range) where none does."""
    k = 1
    while k + 1 <= (n + 1) // 2 and 1 - 2 * _binom_tail(n, k) >= level:
        k += 1
    return k


def median_interval(sorted_xs: list[float], level: float = LEVEL) -> tuple[float, float, float]:
    """(low, high, coverage): the order statistics x(k), x(n+1-k) with the largest k whose exact
    coverage reaches `level`; where none does (n < 6 at 95%), the range with the coverage it has."""
    n = len(sorted_xs)
    k = _median_k(n, level)
    return sorted_xs[k - 1], sorted_xs[n - k], median_coverage(n, level)


def median_coverage(n: int, level: float = LEVEL) -> float:
    """The exact coverage of median_interval's pair at n values (a function of n alone)."""
    return max(0.0, 1 - 2 * _binom_tail(n, _median_k(n, level) - 1)) if n > 0 else 0.0


def median_ci95(sorted_xs: list[float]) -> tuple[float, float]:
    """median_interval at 95% without its coverage (its callers before coverage was stated)."""
    lo, hi, _ = median_interval(sorted_xs, LEVEL)
    return lo, hi


def coverage_text(coverage: float | None) -> str:
    """'96.1%': a coverage as the reports print it beside an interval ('99.2%', '93.8%')."""
    if coverage is None:
        return "coverage unknown"
    pct = 100 * coverage
    return f"{pct:.0f}%" if abs(pct - round(pct)) < 0.05 else f"{pct:.1f}%"


def summarize(times: list[float]) -> dict:
    xs = sorted(times)
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    lo, hi, coverage = median_interval(xs)
    return {
        "median": _quantile(xs, 0.5),
        "mean": mean,
        "p10": _quantile(xs, 0.1),
        "p90": _quantile(xs, 0.9),
        "std": std,
        "ci95_low": lo,  # the keys keep their name; ci_coverage is what the interval covers
        "ci95_high": hi,
        "ci_coverage": coverage,
        "n": n,
        "min": xs[0],
        "max": xs[-1],
    }


@functools.lru_cache(maxsize=256)
def _mann_whitney_counts(m: int, n: int) -> tuple[int, ...]:
    """The number of orderings of m + n values giving U = 0 .. m*n: the coefficients of the Gaussian
    binomial [m + n choose m]_q, built as prod_i (1 - q^(n+i)) / (1 - q^i) (each partial product a
    polynomial), exact in integers."""
    m, n = min(m, n), max(m, n)
    poly = [1]
    for i in range(1, m + 1):
        size = i * n + 1
        grown = poly + [0] * (size + i - len(poly))
        for d in range(len(grown) - 1, n + i - 1, -1):  # times (1 - q^(n+i))
            grown[d] -= grown[d - n - i]
        for d in range(i, len(grown)):  # divided by (1 - q^i)
            grown[d] += grown[d - i]
        poly = grown[:size]
    return tuple(poly)


def _rank_cut(m: int | list[int], n: int | list[int], level: float) -> tuple[int, float, bool]:
    if isinstance(m, int) or len(m) == 1:  # one stratum: a function of its sizes alone, cached
        return _rank_cut_one(m if isinstance(m, int) else m[0], n if isinstance(n, int) else n[0], level)
    return _rank_cut_strata(m, n, level)


@functools.lru_cache(maxsize=1024)
def _rank_cut_one(m: int, n: int, level: float) -> tuple[int, float, bool]:
    return _rank_cut_strata([m], [n], level)


def _rank_cut_strata(m: int | list[int], n: int | list[int], level: float) -> tuple[int, float, bool]:
    """(k, coverage, exact): the interval on the shift is the k-th smallest and k-th largest of the
    pairwise differences, with k the largest whose coverage 1 - 2 P(U <= k - 1) reaches `level` (k = 1,
    the extreme differences, with the coverage it has where none reaches it). Lists of sizes: strata
    (rounds), U the sum of each stratum's, its null distribution their convolution."""
    ms, ns = ([m], [n]) if isinstance(m, int) else (list(m), list(n))
    pairs = sum(a * b for a, b in zip(ms, ns, strict=True))
    if pairs <= EXACT_PAIRS:
        counts, total = [1], 1
        for a, b in zip(ms, ns, strict=True):
            c = _mann_whitney_counts(a, b)
            counts = [
                sum(counts[i] * c[u - i] for i in range(max(0, u - len(c) + 1), min(u, len(counts) - 1) + 1))
                for u in range(len(counts) + len(c) - 1)
            ]
            total *= math.comb(a + b, a)
        cdf = [0] * len(counts)
        for u, c in enumerate(counts):
            cdf[u] = c + (cdf[u - 1] if u else 0)
        k = 1
        while k + 1 <= (pairs + 1) // 2 and 1 - 2 * cdf[k] / total >= level:
            k += 1
        return k, 1 - 2 * cdf[k - 1] / total, True
    sd = math.sqrt(sum(a * b * (a + b + 1) for a, b in zip(ms, ns, strict=True)) / 12)
    z = NormalDist().inv_cdf(0.5 + level / 2)
    k = max(1, math.floor(pairs / 2 - z * sd))
    return k, 1 - 2 * NormalDist().cdf((k - 1 + 0.5 - pairs / 2) / sd), False


def rounds_of(times) -> list[list[float]]:
    """Step times as rounds: a flat list is one round; a list of lists (one per round) stays as it is."""
    times = list(times)
    return [list(r) for r in times] if times and isinstance(times[0], (list, tuple)) else [times]


def ratio_interval(a, b, level: float = LEVEL) -> dict:
    """Run a's step time over run b's: {ratio, low, high, coverage, exact, n_a, n_b, rounds}. a and b: flat
    lists (one launch each): the Hodges-Lehmann ratio of the log step times with its Mann-Whitney interval
    (coverage exact where `exact`), which knows nothing of the load the launch shared. Or one list per
    block (rounds of launches, or interleaved turns, measured close together in time): then the block is
    the unit of replication, and the interval is across blocks (measure.blocks: the sign test's on the
    median block ratio, or Student's t with fewer blocks, `method`; each block's own ratio in
    block_ratios)."""
    from harness.measure.blocks import blocked_interval

    ra, rb = rounds_of(a), rounds_of(b)
    if len(ra) != len(rb):  # rounds that do not pair up: pooled
        ra, rb = [[x for r in ra for x in r]], [[x for r in rb for x in r]]
    la = [[math.log(x) for x in r if x > 0] for r in ra]
    lb = [[math.log(x) for x in r if x > 0] for r in rb]
    strata = [(x, y) for x, y in zip(la, lb, strict=True) if x and y]
    if not strata:
        raise ValueError("ratio_interval needs a positive step time in each run")
    if len(strata) == 1:
        return {**_interval_of(strata, level), "method": "rank"}
    return blocked_interval(strata, level, _interval_of, median_interval)


def _interval_of(strata: list[tuple[list[float], list[float]]], level: float) -> dict:
    diffs = sorted(x - y for xs, ys in strata for x in xs for y in ys)
    k, coverage, exact = _rank_cut([len(x) for x, _ in strata], [len(y) for _, y in strata], level)
    return {
        "ratio": math.exp(_quantile(diffs, 0.5)),
        "low": math.exp(diffs[k - 1]),
        "high": math.exp(diffs[len(diffs) - k]),
        "coverage": coverage,
        "exact": exact,
        "n_a": sum(len(x) for x, _ in strata),
        "n_b": sum(len(y) for _, y in strata),
        "rounds": len(strata),
    }


def min_steps(level: float = LEVEL) -> int:
    """The fewest steps per run (equal in both) at which the rank interval can reach `level`."""
    n = 1
    while _rank_cut(n, n, level)[1] < level:
        n += 1
    return n


def decide(interval: dict, level: float = LEVEL, resolution: float = RESOLUTION) -> dict:
    """The verdict on a ratio interval (ratio_interval's): `interval` plus verdict ("faster": a is faster
    than b, "slower", "not distinguishable": the interval within the equivalence margin `resolution` either
    way, "undecided"), resolution, level and, where undecided, steps_needed (one block: the steps per run)
    or blocks_needed (measured in blocks: the rounds or turns), at which an interval of the observed spread
    would decide (exclude 1, or fit within the margin around an estimate that stays where it is)."""
    from harness.measure.blocks import blocks_needed

    est, low, high, cov = interval["ratio"], interval["low"], interval["high"], interval["coverage"]
    band = math.log1p(resolution)
    out = {**interval, "level": level, "resolution": resolution, "steps_needed": None, "blocks_needed": None}
    if cov >= level and high < 1:
        return {**out, "verdict": "faster"}
    if cov >= level and low > 1:
        return {**out, "verdict": "slower"}
    if cov >= level and low >= 1 / (1 + resolution) and high <= 1 + resolution:
        return {**out, "verdict": "not distinguishable"}
    if interval.get("rounds", 1) > 1:  # the blocks, not the steps in each, replicate the load
        return {**out, "verdict": "undecided", "blocks_needed": blocks_needed(interval, level, resolution)}
    half = max(math.log(high / est), math.log(est / low), 1e-12)
    e = abs(math.log(est))
    target = max(e, band - e)
    n = 2 * interval["n_a"] * interval["n_b"] / (interval["n_a"] + interval["n_b"])
    needed = max(min_steps(level), math.ceil(n * (half / target) ** 2)) if target > 0 else None
    return {**out, "verdict": "undecided", "steps_needed": needed}


def compare_times(a: list[float], b: list[float], level: float = LEVEL, resolution: float = RESOLUTION) -> dict:
    """decide(ratio_interval(a, b)): run a's step times against run b's."""
    return decide(ratio_interval(a, b, level), level, resolution)


def widen(interval: dict, factor: float) -> dict:
    """The ratio interval widened by a load drift `factor` (>= 1) either way: what two runs measured at
    different moments may differ by from load alone; its coverage is then no longer exact (None)."""
    if factor <= 1:
        return interval
    return {**interval, "low": interval["low"] / factor, "high": interval["high"] * factor, "drift_factor": factor}


BLOCK_METHODS = {
    "sign": "the order-statistic interval of the median of the {r} {unit}s' own ratios (sign test, exact)",
    "t": "Student's t on the mean of the {r} {unit}s' own log ratios, {df} df, coverage nominal",
}


def verdict_text(d: dict, a: str = "", b: str = "", unit: str = "round") -> str:
    """'slower: 1.78x [1.45, 2.10] (95%)', with 'would need ~40 steps per run' where undecided; measured in
    blocks (`unit`: round or turn), how the interval was taken across them."""
    drift = f", widened by the measured load drift {d['drift_factor']:.2f}x" if d.get("drift_factor") else ""
    r, unit = d.get("rounds", 1), d.get("unit") or unit
    if r > 1 and d.get("method") in BLOCK_METHODS:
        drift += ", " + BLOCK_METHODS[d["method"]].format(r=r, unit=unit, df=r - 1)
        drift += " (floored at the within-round spread)" if d.get("floored") else ""
    shown = f"{d['ratio']:.3f}x [{d['low']:.3f}, {d['high']:.3f}] ({coverage_text(d['coverage'])}{drift})"
    who = f"{a} against {b}: " if a and b else ""
    text = f"{who}{d['verdict']}: {shown}"
    if d["verdict"] == "not distinguishable":
        text += f", any difference under {100 * d['resolution']:g}% (the equivalence margin)"
    if d["verdict"] == "undecided" and d.get("steps_needed"):
        text += f"; would need ~{d['steps_needed']} measured steps per run"
    elif d["verdict"] == "undecided" and d.get("blocks_needed"):
        more = " (more rounds decide, not more steps in each)" if unit == "round" else ""
        text += f"; would need ~{d['blocks_needed']} {unit}s{more}"
    return text
