"""Why one run is slower than another, in numbers: the components of the step breakdown whose
difference covers most of the step-time difference. One logic for the compare and the sweep
reports, so both explain a winner the same way.

Which run is slower, and whether it is slower at all, is the measurement's call, never the
breakdown's: the interval on the ratio of the two runs' step times (measure.stats.compare_times: the
Hodges-Lehmann ratio with its Mann-Whitney interval at 95%, widened by the comparison's measured load
drift) decides "slower"; where it holds 1 the runs are "not distinguishable" (within 10%) or
"undecided" (with the steps it would need) and get no explanation; runs without step times fall
back to their medians' intervals, which must not overlap; a breakdown whose total is off its run's measured median
by more than TOLERANCE describes other steps than the measured ones and explains nothing; a share
of the difference is printed only where every named component moved the way the step did by no
more than the whole difference (no share above 100% or below 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.measure.stats import compare_times, coverage_text, median_coverage, rounds_of, verdict_text, widen
from harness.report.data import Breakdown, component_title

COVER = 0.8  # name components, largest first, until they cover this share of the difference
MAX_NAMED = 3
TOLERANCE = 0.10  # a breakdown explains its run's measured steps only if its total is this close to their median


@dataclass(frozen=True)
class Case:
    """A run as the explanation sees it: its name, what it is compared by, its breakdown."""

    label: str
    engine: str  # the engine variant (spec.engine_variant)
    layout: str  # everything but the engine (data.layout_key)
    step_s: float | None  # the measured median step: which run is faster
    breakdown: Breakdown
    ci_s: tuple | None = None  # the 95% confidence interval of that median (low, high), seconds
    # a MoE run's expert load: routed tokens per expert, max over mean, worst layer (median measured step)
    imbalance: float | None = None
    times_s: tuple | None = None  # every measured step's time (s), or one tuple per round: the ratio interval's data
    drift: float = 1.0  # the comparison's measured load drift factor (>= 1) its ratio intervals are widened by


def off_median(b: Breakdown, median_s: float | None) -> float | None:
    """How far the breakdown's total is from the measured median, as a fraction of it (None: no median)."""
    if not median_s or median_s <= 0:
        return None
    return b.step_ms / (1e3 * median_s) - 1.0


def representative(b: Breakdown, median_s: float | None) -> bool:
    """Whether the breakdown describes the measured steps: its total within TOLERANCE of their median."""
    off = off_median(b, median_s)
    return off is not None and abs(off) <= TOLERANCE


def against_median(b: Breakdown, median_s: float | None) -> str:
    """How the breakdown's sum compares with its run's measured median; flagged beyond TOLERANCE."""
    off = off_median(b, median_s)
    if off is None:
        return "no measured median"
    flag = f": off by more than {100 * TOLERANCE:.0f}%, not used by Why" if abs(off) > TOLERANCE else ""
    return f"{100 * off:+.0f}%{flag}"


def _ms(c: Case) -> str:
    text = f"{1e3 * c.step_s:.1f} ms"
    n = sum(len(r) for r in rounds_of(c.times_s)) if c.times_s else 0
    coverage = f" {coverage_text(median_coverage(n))}" if n else ""
    return text + (f" [{1e3 * c.ci_s[0]:.1f}, {1e3 * c.ci_s[1]:.1f}]{coverage}" if c.ci_s else "")


def decision(fast: Case, slow: Case) -> dict | None:
    """The slower-by-median run's step times against the faster's (measure.stats.compare_times), its
    interval widened by the larger load drift of the two; None where either has no step times."""
    if not fast.times_s or not slow.times_s:
        return None
    d = compare_times(list(slow.times_s), list(fast.times_s))
    factor = max(fast.drift, slow.drift)
    if factor > 1 and d["verdict"] in ("slower", "faster"):  # decided only if the widened interval still excludes 1
        w = widen(d, factor)
        d = w if w["low"] > 1 or w["high"] < 1 else {**w, "verdict": "undecided", "steps_needed": None}
    return d


def distinguishable(fast: Case, slow: Case) -> bool:
    """Whether the slower-by-median run is slower: its ratio interval to the faster one lies above 1
    (decision); without step times, its median's interval lies wholly above the faster one's (without
    intervals: the medians differ)."""
    d = decision(fast, slow)
    if d is not None:
        return d["verdict"] == "slower"
    if fast.ci_s and slow.ci_s:
        return slow.ci_s[0] > fast.ci_s[1]
    return slow.step_s > fast.step_s


def _undecided(fast: Case, slow: Case) -> str:
    """Why two runs get no explanation: the ratio interval's verdict, or the medians' intervals overlap."""
    d = decision(fast, slow)
    if d is None:
        return "not distinguishable (the 95% confidence intervals of the median step overlap)"
    return "step time ratio " + verdict_text(d)


def _ratio(fast: Case, slow: Case) -> str:
    d = decision(fast, slow)
    return f"; ratio {verdict_text(d).removeprefix('slower: ')}" if d else ""


def _not_representative(c: Case) -> str:
    return (
        f"{c.label}'s breakdown totals {c.breakdown.step_ms:.1f} ms against its measured median "
        f"{1e3 * c.step_s:.1f} ms (off by more than {100 * TOLERANCE:.0f}%)"
    )


def explain(a: Case, b: Case) -> str:
    """One sentence on two runs, the slower by measured median named first: not distinguishable,
    not explained (and why), or the components whose difference explains most of it; for MoE runs
    whose expert load differs, what each run's most loaded expert had (the wait it sets is inside
    compute and the ep communication, not a component of its own)."""
    text = _explain(a, b)
    if a.imbalance is None or b.imbalance is None or abs(a.imbalance - b.imbalance) < 0.005:
        return text
    return (
        f"{text} Expert load (tokens per expert, max over mean, worst layer): {a.label} {a.imbalance:.2f}, "
        f"{b.label} {b.imbalance:.2f}."
    )


def _explain(a: Case, b: Case) -> str:
    if a.step_s is None or b.step_s is None:
        missing = a if a.step_s is None else b
        return f"{b.label} against {a.label}: not explained ({missing.label} has no measured median)."
    fast, slow = sorted((a, b), key=lambda c: c.step_s)
    if not distinguishable(fast, slow):
        return (
            f"{slow.label} ({_ms(slow)}) and {fast.label} ({_ms(fast)}): {_undecided(fast, slow)}; nothing to explain."
        )
    head = (
        f"{slow.label} takes {1e3 * (slow.step_s - fast.step_s):.1f} ms more per measured step than "
        f"{fast.label} (median {1e3 * slow.step_s:.1f} against {1e3 * fast.step_s:.1f} ms{_ratio(fast, slow)})"
    )
    off = [c for c in (slow, fast) if not representative(c.breakdown, c.step_s)]
    if off:
        return f"{head}; not explained: " + "; ".join(_not_representative(c) for c in off) + "."
    x, y = fast.breakdown, slow.breakdown
    diff = y.step_ms - x.step_ms
    keys = list(dict.fromkeys([*x.parts, *y.parts]))
    deltas = {k: y.parts.get(k, 0.0) - x.parts.get(k, 0.0) for k in keys}
    moved = ", ".join(
        f"{component_title(k)} {deltas[k]:+.1f} ms"
        for k in sorted(keys, key=lambda k: -abs(deltas[k]))
        if abs(deltas[k]) >= 0.05  # what rounds to +0.0 ms did not move
    )
    if diff <= 0:
        return f"{head}; not explained: the breakdowns differ by {diff:+.1f} ms, the other way ({moved})."
    along = sorted((k for k in keys if deltas[k] > 0), key=lambda k: -deltas[k])
    if along and deltas[along[0]] > diff:
        return (
            f"{head}; the components moved both ways, by more than the {diff:.1f} ms between the breakdowns "
            f"({y.step_ms:.1f} against {x.step_ms:.1f} ms): {moved}; no share of the difference is any one "
            "component's."
        )
    named, covered = [], 0.0
    for k in along:
        if len(named) == MAX_NAMED or covered >= COVER * diff:
            break
        named.append(k)
        covered += deltas[k]
    against = [k for k in sorted(keys, key=lambda k: deltas[k]) if deltas[k] < 0 and -deltas[k] >= 0.1 * diff]
    text = f"{head}; by the breakdowns ({y.step_ms:.1f} against {x.step_ms:.1f} ms): " + ", ".join(
        f"{component_title(k)} {deltas[k]:+.1f} ms ({100 * deltas[k] / diff:.0f}% of the difference)" for k in named
    )
    if against:
        text += "; partly offset by " + ", ".join(f"{component_title(k)} {deltas[k]:+.1f} ms" for k in against)
    return text + "."


def _rank(c: Case) -> float:
    return c.step_s if c.step_s is not None else float("inf")


def _grouped(cases: list[Case], by, other, limit: int | None, yardstick=lambda c: False) -> list[str]:
    """Per group (same `by`), its fastest run against each run of the group that differs in `other`, then
    the group's `yardstick` run (when it is not the fastest) against the others; groups in the order of
    their fastest run, so the fastest run overall comes first."""
    groups: dict = {}
    for c in sorted(cases, key=_rank):
        groups.setdefault(by(c), []).append(c)
    out = []
    for members in groups.values():
        anchors = [members[0], *(c for c in members[1:] if yardstick(c))]
        done = set()
        for a in anchors:
            for c in members:
                if other(c) != other(a) and frozenset((id(a), id(c))) not in done:
                    done.add(frozenset((id(a), id(c))))
                    out.append(explain(a, c))
    return out[:limit] if limit else out


def comparisons(cases: list[Case], limit: int | None = None) -> tuple[list[str], list[str]]:
    """(the same layout under other engines, the same engine at other layouts): one sentence per pair.
    Within a layout the own engine is the second yardstick: each framework against the harness's explicit
    Megatron-style implementation of the same layout, whichever engine was fastest."""
    return (
        _grouped(cases, lambda c: c.layout, lambda c: c.engine, limit, yardstick=lambda c: c.engine == "own"),
        _grouped(cases, lambda c: c.engine, lambda c: c.layout, limit),
    )
