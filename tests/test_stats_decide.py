"""Statistics that decide: the median's interval states its real coverage, two runs
are compared by an interval on the ratio of their step times (Hodges-Lehmann on log times with its
exact Mann-Whitney interval), and the verdict is faster / slower / not distinguishable / undecided with
the steps it would need. Synthetic step-time lists only: no process starts."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from harness.measure import stats
from harness.measure.stats import (
    compare_times,
    coverage_text,
    median_coverage,
    median_interval,
    ratio_interval,
    summarize,
    verdict_text,
)
from harness.report.data import breakdown_of
from harness.report.why import Case, explain

# reports/compare-cpu-default.json at main 7c12545 (ms): the example
OWN_DP2 = [16.11, 14.15, 22.85, 17.77, 22.89, 13.52, 15.3, 13.33]
ZERO1 = [21.68, 28.08, 33.32, 37.96, 31.05, 27.79, 27.37, 25.2]
ZERO2 = [47.18, 30.56, 32.44, 37.57, 27.07, 33.65, 34.6, 25.2]


def test_the_median_interval_states_its_real_coverage():
    # n = 8: the only pair reaching 95% is the range, which covers 1 - 2/256
    assert median_interval(sorted(OWN_DP2)) == (13.33, 22.89, 1 - 2 / 256)
    assert coverage_text(median_coverage(8)) == "99.2%"
    # below 6 steps no pair reaches 95%: the range, at what it covers (the MoE report's 5 steps: 93.75%)
    assert median_coverage(5) == 0.9375 and coverage_text(0.9375) == "93.8%"
    lo, hi, cov = median_interval([float(x) for x in range(50)])
    assert (lo, hi) == (17.0, 32.0) and cov == pytest.approx(0.9672, abs=1e-4)  # the textbook pair, 96.7%
    s = summarize(OWN_DP2)
    assert s["ci_coverage"] == 1 - 2 / 256 and (s["ci95_low"], s["ci95_high"]) == (13.33, 22.89)


def test_the_exact_rank_distribution_matches_enumeration():
    """The Mann-Whitney null counts (Gaussian binomial) against counting every ordering of m + n values."""
    for m, n in [(1, 1), (2, 3), (3, 3), (4, 5)]:
        counts = [0] * (m * n + 1)
        for xs in itertools.combinations(range(m + n), m):
            counts[sum(1 for x in xs for y in set(range(m + n)) - set(xs) if x > y)] += 1
        assert list(stats._mann_whitney_counts(m, n)) == counts, (m, n)
    k, coverage, exact = stats._rank_cut(8, 8, 0.95)
    assert (k, exact) == (14, True) and coverage == pytest.approx(0.9501, abs=1e-4)  # U critical value 13 at 8, 8


def test_a_run_slower_in_62_of_64_pairs_is_decided_slower():
    """The issue's case: DeepSpeed ZeRO-1 against own dp2, whose medians' ranges overlap (21.7 < 22.9) and
    were read as 'not distinguishable'; the ratio interval excludes 1."""
    assert sum(a > b for a in ZERO1 for b in OWN_DP2) == 62
    d = compare_times(ZERO1, OWN_DP2)
    assert d["verdict"] == "slower" and d["low"] > 1.3 and d["coverage"] >= 0.95
    assert compare_times(OWN_DP2, ZERO1)["verdict"] == "faster"
    assert verdict_text(d) == "slower: 1.764x [1.359, 2.107] (95%)"


def test_identical_distributions_are_not_distinguishable():
    rng = random.Random(41)
    a = [0.020 * math.exp(rng.gauss(0, 0.03)) for _ in range(30)]
    b = [0.020 * math.exp(rng.gauss(0, 0.03)) for _ in range(30)]
    d = compare_times(a, b)
    assert d["verdict"] == "not distinguishable" and 1 / 1.1 <= d["low"] <= 1 <= d["high"] <= 1.1
    assert "any difference under 10%" in verdict_text(d)


def test_too_few_or_too_noisy_steps_are_undecided_with_the_steps_they_would_need():
    # 3 steps each, every pair one way: the full range covers 90% only, so nothing is decided at 95%
    d = compare_times([0.03, 0.031, 0.032], [0.02, 0.021, 0.022])
    assert d["verdict"] == "undecided" and d["coverage"] == pytest.approx(0.9) and d["steps_needed"] >= 4
    # ZeRO-2 against ZeRO-1 at 8 steps: the interval holds 1 and reaches 37% past it
    d = compare_times(ZERO2, ZERO1)
    assert d["verdict"] == "undecided" and d["low"] < 1 < d["high"] and d["steps_needed"] > 8
    assert verdict_text(d).endswith(f"; would need ~{d['steps_needed']} measured steps per run")


def test_the_interval_covers_a_known_ratio_at_its_stated_rate():
    """Simulated runs 1.25x apart: the 95% interval holds 1.25 in about 95% of draws (exact coverage
    under the shift model); a normal approximation above EXACT_PAIRS pairs holds it too."""
    rng = random.Random(7)
    hits = 0
    for _ in range(300):
        a = [1.25 * math.exp(rng.gauss(0, 0.2)) for _ in range(8)]
        b = [math.exp(rng.gauss(0, 0.2)) for _ in range(8)]
        r = ratio_interval(a, b)
        hits += r["low"] <= 1.25 <= r["high"]
    assert 0.91 <= hits / 300 <= 0.99
    big = ratio_interval([2 * math.exp(rng.gauss(0, 0.1)) for _ in range(80)], [1.0 + 0.0 * i for i in range(80)])
    assert not big["exact"] and big["low"] < 2.0 < big["high"] and big["coverage"] == pytest.approx(0.95, abs=0.01)


def _case(label: str, times_ms: list[float], drift: float = 1.0, **parts) -> Case:
    median = sorted(times_ms)[len(times_ms) // 2] / 1e3
    b = breakdown_of({"breakdown_measured_ms": {**parts, "exposed_comm": {}, "step": 1e3 * median}})
    lo, hi, _ = median_interval(sorted(times_ms))
    times = tuple(t / 1e3 for t in times_ms)
    return Case(label, "x", "dp2", median, b, (lo / 1e3, hi / 1e3), None, times, drift)


def test_why_decides_by_the_ratio_interval_not_by_overlapping_ranges():
    fast = _case("own dp2", OWN_DP2, compute=10.0)
    slow = _case("deepspeed ZeRO-1", ZERO1, compute=20.0)
    text = explain(fast, slow)
    assert text.startswith("deepspeed ZeRO-1 takes ") and "ratio 1.764x [1.359, 2.107] (95%)" in text, text
    assert "not distinguishable" not in text
    undecided = explain(_case("deepspeed ZeRO-2", ZERO2, compute=33.0), slow)
    assert "undecided" in undecided and "would need ~" in undecided and "nothing to explain" in undecided
    assert "28.1 ms [21.7, 38.0] 99.2%" in undecided  # each median's interval with its coverage


def test_a_verdict_is_widened_by_the_load_drift_the_comparison_measured():
    """Runs measured at different moments of a comparison whose first run, measured again at the end, came
    back 30% slower: a 1.2x difference is what the load alone may make, so it is not decided slower."""
    rng = random.Random(3)
    a = [20.0 * math.exp(rng.gauss(0, 0.02)) for _ in range(20)]
    b = [24.0 * math.exp(rng.gauss(0, 0.02)) for _ in range(20)]
    assert "takes" in explain(_case("a", a, compute=20.0), _case("b", b, compute=24.0))  # steady machine: slower
    drifted = explain(_case("a", a, drift=1.3, compute=20.0), _case("b", b, drift=1.3, compute=24.0))
    assert "undecided" in drifted and "widened by the measured load drift 1.30x" in drifted, drifted


def test_the_sweep_report_doubts_a_lead_the_ratio_interval_does_not_decide():
    """recommend.doubt: a winner whose step-time ratio interval holds 1 is not called the winner outright
    (the medians' ranges used to decide, overlapping or not)."""
    from harness.report.data import Metric, to_row
    from harness.report.recommend import doubt

    def row(times_ms):
        times = [t / 1e3 for t in times_ms]
        median = sorted(times)[len(times) // 2]
        lo, hi, _ = median_interval(sorted(times))
        st = {"median": median, "ci95_low": lo, "ci95_high": hi, "n": len(times)}
        rec = {"status": "ok", "spec": {"layout": {"engine": "own", "dp": 2}}, "fingerprint": {"world_size": 2}}
        rec["metrics"] = {"step_time_s": st, "step_times_s": times, "tokens_per_s": 512 / median}
        rec["metrics"]["tokens_per_s_per_device"] = 256 / median
        return to_row(rec)

    metric = Metric("tokens_per_s_dev", "tokens/s per device", False, "tokens/s per device")
    assert doubt(row(OWN_DP2), row(ZERO1), metric) is None  # decided faster: 62 of 64 pairs
    said = doubt(row(ZERO1), row(ZERO2), metric)
    assert said.startswith("the step time ratio is undecided: ") and "would need ~" in said, said


def test_the_load_drift_sentence_says_what_its_check_decided():
    """An undecided check (too few steps to reach the interval's level) rules no drift out: only a check whose
    interval holds 1 within the margin may say it found none, and a decided one widens every pair."""
    from harness.report.drift import load_drift_text

    def text(verdict, low, high):
        d = {"run": "ref", "verdict": verdict, "low": low, "high": high, "ratio": (low + high) / 2, "coverage": 0.9}
        d["resolution"] = 0.1
        return load_drift_text({"load_drift": d})

    assert "no drift is ruled out" in text("undecided", 0.303, 0.474) and "no drift found" not in text(
        "undecided", 0.303, 0.474
    )
    assert "no drift found" in text("not distinguishable", 0.95, 1.05)
    assert "widened by 1.30x" in text("slower", 1.1, 1.3)
