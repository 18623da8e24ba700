"""Why one run is slower than another, in numbers: the components of the step breakdown whose
difference covers most of the step-time difference. One logic for the compare and the sweep
reports, so both explain a winner the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.report.data import Breakdown, component_title

COVER = 0.8  # name components, largest first, until they cover this share of the difference
MAX_NAMED = 3
SAME = 0.01  # steps within 1% (and 0.05 ms) count as the same time


@dataclass(frozen=True)
class Case:
    """A run as the explanation sees it: its name, what it is compared by, its breakdown."""

    label: str
    engine: str  # the engine variant (spec.engine_variant)
    layout: str  # everything but the engine (data.layout_key)
    step_s: float | None  # the measured median step: which run is faster
    breakdown: Breakdown


def _delta_text(key: str, delta: float, diff: float) -> str:
    return f"{component_title(key)} {delta:+.1f} ms ({100 * delta / diff:.0f}% of the difference)"


def explain(fast: Case, slow: Case) -> str:
    """One sentence: how much longer `slow`'s profiled step is than `fast`'s, and the components
    whose difference explains most of it (with the ones that moved the other way, if they matter)."""
    a, b = fast.breakdown, slow.breakdown
    diff = b.step_ms - a.step_ms
    head = f"{slow.label} ({b.step_ms:.1f} ms per profiled step) against {fast.label} ({a.step_ms:.1f} ms)"
    if abs(diff) < max(0.05, SAME * a.step_ms):
        return f"{head}: the same within {abs(diff):.1f} ms; no component explains a difference."
    keys = list(dict.fromkeys([*a.parts, *b.parts]))
    deltas = {k: b.parts.get(k, 0.0) - a.parts.get(k, 0.0) for k in keys}
    along = sorted((k for k in keys if deltas[k] * diff > 0), key=lambda k: -abs(deltas[k]))
    named, covered = [], 0.0
    for k in along:
        if len(named) == MAX_NAMED or covered >= COVER * abs(diff):
            break
        named.append(k)
        covered += abs(deltas[k])
    against = [
        k
        for k in sorted(keys, key=lambda k: -abs(deltas[k]))
        if deltas[k] * diff < 0 and abs(deltas[k]) >= 0.1 * abs(diff)
    ]
    text = (
        f"{slow.label} takes {abs(diff):.1f} ms {'more' if diff > 0 else 'less'} per profiled step than "
        f"{fast.label} ({b.step_ms:.1f} against {a.step_ms:.1f} ms): "
        + ", ".join(_delta_text(k, deltas[k], diff) for k in named)
    )
    if against:
        text += "; partly offset by " + ", ".join(f"{component_title(k)} {deltas[k]:+.1f} ms" for k in against)
    return text + "."


def _rank(c: Case) -> float:
    return c.step_s if c.step_s is not None else c.breakdown.step_ms / 1e3


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
