"""Why one run is slower than another, in numbers: every component of the step breakdown that moved
by MOVED of the difference or more, either way (the ones with the step with their share of it, the
ones against it as what partly offset it), between runs that differ in one factor (the engine alone,
or one layout field: factors()). One logic for the compare and the sweep reports, so both explain a
winner the same way.

Which run is slower, and whether it is slower at all, is the measurement's call, never the
breakdown's: the interval on the ratio of the two runs' step times (measure.stats.compare_times: the
Hodges-Lehmann ratio with its Mann-Whitney interval at 95%, widened by the comparison's measured load
drift) decides "slower"; where it holds 1 the runs are "not distinguishable" (within 10%) or
"undecided" (with the steps it would need) and get no explanation; runs without step times fall
back to their medians' intervals, which must not overlap; a breakdown whose step (its clocked components
plus what no clock covers) is more than TOLERANCE off its run's measured median describes other steps, and
one whose clocked components (every part but what no clock covers) sum to more than TOLERANCE above that
median counted a part twice: either explains nothing; what no clock covers is said apart, with its share
of the difference so that a reader sees how much of it the clocks leave unexplained, never a component; a share
of the difference is printed only where every named component moved the way the step did by no
more than the whole difference (no share above 100% or below 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.measure.stats import compare_times, coverage_text, median_coverage, rounds_of, verdict_text, widen
from harness.parallel_dims import DEGREES, ParallelDims
from harness.report.data import Breakdown, component_title

MOVED = 0.10  # a component that moved by this share of the difference or more, either way, is named
TOLERANCE = 0.10  # a breakdown explains its run's measured steps only if its total is this close to their median


@dataclass(frozen=True)
class Case:
    """A run as the explanation sees it: its name, what it is compared by, its breakdown."""

    label: str
    engine: str  # the engine variant (spec.engine_variant)
    layout: str  # everything but the engine (data.layout_key)
    step_s: float | None  # the measured median step: which run is faster
    breakdown: Breakdown
    ci_s: tuple | None = None  # the interval of that median (low, high), seconds (its coverage: _ms, from n)
    # a MoE run's expert load: routed tokens per expert, max over mean, worst layer (median measured step)
    imbalance: float | None = None
    times_s: tuple | None = None  # every measured step's time (s), or one tuple per block: the ratio interval's data
    drift: float = 1.0  # the comparison's measured load drift factor (>= 1) its ratio intervals are widened by
    # what the run is, factor by factor (factors()): two runs of one engine are compared only where one
    # factor differs; None (old callers): every pair
    fields: dict | None = None
    unit: str = "round"  # what times_s's blocks are: launch rounds (compare --rounds) or turns (--interleave)


UNCLOCKED = "unattributed"  # the step less its clocked components: shown, never a component of the explanation


def clocked_ms(b: Breakdown) -> float:
    """The sum of the breakdown's measured components: every part but what no clock covers (UNCLOCKED,
    the rest of the step by definition, which would close any sum)."""
    return sum(v for k, v in b.parts.items() if k != UNCLOCKED)


def off_median(b: Breakdown, median_s: float | None) -> float | None:
    """How far the clocked components' sum is from the measured median, as a fraction of it (None: no
    median): -0.08 where the clocks cover 92% of the median step; above 0 where clocks overlapped (a part
    counted twice) or the profiled steps ran longer than the measured ones. It can fail: nothing closes it."""
    if not median_s or median_s <= 0:
        return None
    return clocked_ms(b) / (1e3 * median_s) - 1.0


def step_off(b: Breakdown, median_s: float | None) -> float | None:
    """How far the breakdown's step (clocked parts and what no clock covers) is from the measured median, as
    a fraction of it (None: no median): whether the breakdown describes steps like the measured ones."""
    if not median_s or median_s <= 0:
        return None
    return b.step_ms / (1e3 * median_s) - 1.0


def representative(b: Breakdown, median_s: float | None) -> bool:
    """Whether the breakdown can explain the measured steps: its step is within TOLERANCE of their median,
    and its clocked components sum to no more than 1 + TOLERANCE of it (more: a part counted twice). Clocks
    that cover less leave the rest 'not clocked', which Why says with its share rather than hiding."""
    off, step = off_median(b, median_s), step_off(b, median_s)
    return off is not None and step is not None and abs(step) <= TOLERANCE and off <= TOLERANCE


def against_median(b: Breakdown, median_s: float | None) -> str:
    """How much of the measured median the clocked components cover ('92%'); flagged where Why cannot use
    the breakdown (representative)."""
    off, step = off_median(b, median_s), step_off(b, median_s)
    if off is None or step is None:
        return "no measured median"
    if abs(step) > TOLERANCE:
        return (
            f"{100 * (1 + off):.0f}%; its step {100 * (1 + step):.0f}% of the median (off by more than "
            f"{100 * TOLERANCE:.0f}%), not used by Why"
        )
    if off > TOLERANCE:
        return f"{100 * (1 + off):.0f}%: above {100 * (1 + TOLERANCE):.0f}% (clocks overlap), not used by Why"
    return f"{100 * (1 + off):.0f}%"


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
    d = {**compare_times(list(slow.times_s), list(fast.times_s)), "unit": slow.unit}
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
        return "not distinguishable (the intervals of the median step overlap)"
    return "step time ratio " + verdict_text(d)


def _ratio(fast: Case, slow: Case) -> str:
    d = decision(fast, slow)
    return f"; ratio {verdict_text(d).removeprefix('slower: ')}" if d else ""


def _not_representative(c: Case) -> str:
    if abs(step_off(c.breakdown, c.step_s) or 0.0) > TOLERANCE:
        return (
            f"{c.label}'s breakdown describes a {c.breakdown.step_ms:.1f} ms step against its measured median "
            f"{1e3 * c.step_s:.1f} ms (off by more than {100 * TOLERANCE:.0f}%)"
        )
    return (
        f"{c.label}'s clocked components sum to {clocked_ms(c.breakdown):.1f} ms, more than "
        f"{100 * (1 + TOLERANCE):.0f}% of its measured median {1e3 * c.step_s:.1f} ms (clocks overlap)"
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
    keys = [k for k in dict.fromkeys([*x.parts, *y.parts]) if k != UNCLOCKED]  # measured components only
    deltas = {k: y.parts.get(k, 0.0) - x.parts.get(k, 0.0) for k in keys}
    gap = y.parts.get(UNCLOCKED, 0.0) - x.parts.get(UNCLOCKED, 0.0)
    unclocked = ""  # said apart, never a component, with its share where there is a difference to share
    if abs(gap) >= 0.05:
        pct = round(100 * gap / diff) if diff > 0 else 0
        share = f" ({pct}% of the difference, what no clock covers)" if pct else ""
        unclocked = f"; not clocked {gap:+.1f} ms{share}"
    moved = ", ".join(
        f"{component_title(k)} {deltas[k]:+.1f} ms"
        for k in sorted(keys, key=lambda k: -abs(deltas[k]))
        if abs(deltas[k]) >= 0.05  # what rounds to +0.0 ms did not move
    )
    if diff <= 0:
        return f"{head}; not explained: the breakdowns differ by {diff:+.1f} ms, the other way ({moved}){unclocked}."
    along = sorted((k for k in keys if deltas[k] > 0), key=lambda k: -deltas[k])
    if along and deltas[along[0]] > diff:
        return (
            f"{head}; the components moved both ways, by more than the {diff:.1f} ms between the breakdowns "
            f"({y.step_ms:.1f} against {x.step_ms:.1f} ms): {moved}; no share of the difference is any one "
            f"component's{unclocked}."
        )
    named = [k for k in along if deltas[k] >= MOVED * diff] or along[:1]
    against = [k for k in sorted(keys, key=lambda k: deltas[k]) if deltas[k] < 0 and -deltas[k] >= MOVED * diff]
    text = f"{head}; by the breakdowns ({y.step_ms:.1f} against {x.step_ms:.1f} ms): " + ", ".join(
        f"{component_title(k)} {deltas[k]:+.1f} ms ({100 * deltas[k] / diff:.0f}% of the difference)" for k in named
    )
    if against:
        text += "; partly offset by " + ", ".join(f"{component_title(k)} {deltas[k]:+.1f} ms" for k in against)
    return text + unclocked + "."


def _rank(c: Case) -> float:
    return c.step_s if c.step_s is not None else float("inf")


SPLIT = "parallel split"  # the degrees, one factor: at a fixed world size one cannot move without another


def factors(layout: dict) -> dict:
    """A layout factor by factor, the engine left out: the parallel split (every degree at once) and each
    other field as it is (the attention and norm kernels, sequence parallelism are fields)."""
    lay = dict(layout or {})
    out = {k: v for k, v in sorted(lay.items()) if k != "engine" and k not in DEGREES}
    out[SPLIT] = ParallelDims.of(lay).label()
    return out


def differing(a: Case, b: Case) -> list[str] | None:
    """The factors two runs differ in (their `fields`); None where either does not say."""
    if a.fields is None or b.fields is None:
        return None
    return [k for k in sorted(set(a.fields) | set(b.fields)) if a.fields.get(k) != b.fields.get(k)]


def _one_factor(a: Case, b: Case) -> bool:
    found = differing(a, b)
    return found is None or len(found) == 1


def _grouped(cases: list[Case], by, other, limit: int | None, yardstick=lambda c: False, single=False) -> list[str]:
    """Per group (same `by`), its fastest run against each run of the group that differs in `other`, then
    the group's `yardstick` run (when it is not the fastest) against the others; groups in the order of
    their fastest run, so the fastest run overall comes first. `single`: a run is compared with the
    fastest run of its group that differs from it in one factor only (_one_factor), none where no such
    run ran (said once per group)."""
    groups: dict = {}
    for c in sorted(cases, key=_rank):
        groups.setdefault(by(c), []).append(c)
    out = []
    for members in groups.values():
        anchors = [members[0], *(c for c in members[1:] if yardstick(c))]
        done, alone = set(), []
        for a in anchors:
            for c in members:
                if other(c) == other(a) or frozenset((id(a), id(c))) in done:
                    continue
                partner = a
                if single and not _one_factor(a, c):
                    partner = next((m for m in members if m is not c and _one_factor(m, c)), None)
                    if partner is None or frozenset((id(partner), id(c))) in done:
                        if partner is None and c not in alone:
                            alone.append(c)
                        continue
                done.add(frozenset((id(partner), id(c))))
                out.append(explain(partner, c))
        if alone:
            out.append(
                "Not compared (no run of the same engine differs from them in one layout field only): "
                + ", ".join(c.label for c in alone)
                + "."
            )
    return out[:limit] if limit else out


def comparisons(cases: list[Case], limit: int | None = None) -> tuple[list[str], list[str]]:
    """(the same layout under other engines, the same engine at other layouts): one sentence per pair.
    Within a layout the own engine is the second yardstick: each framework against the harness's explicit
    Megatron-style implementation of the same layout, whichever engine was fastest. Within an engine, two
    runs are compared only where their layouts differ in one factor (factors()): the fastest run of the
    engine where it is one factor away, else the fastest run that is."""
    return (
        _grouped(cases, lambda c: c.layout, lambda c: c.engine, limit, yardstick=lambda c: c.engine == "own"),
        _grouped(cases, lambda c: c.engine, lambda c: c.layout, limit, single=True),
    )
