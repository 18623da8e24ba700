"""The sweep report's breakdown section: where each layout's step goes (the profiled steps'
components), and the why sentences that explain an ablation's winner from the components that moved."""

from __future__ import annotations

from harness.report import plots
from harness.report.data import COMPONENTS, Metric, Row, component_title
from harness.report.ranking import MAX_SWEEP_FIGS, best_per, by_sweep, ranked, sort_key
from harness.report.sections import Section, Table
from harness.report.why import Case, against_median, comparisons, explain, factors


def breakdown(rows: list[Row], metric: Metric) -> Section:
    s = Section(
        "breakdown",
        "Where the time goes",
        [
            "For the best layouts of each sweep, the mean over ranks: compute (clocked: forward and backward, "
            "less the collectives inside them), exposed communication per axis of degree > 1, pipeline "
            "transfers apart from the pipeline bubble (pp > 1) or waiting for other ranks (without a pipeline), "
            "optimizer and other, and apart what no clock covers (not clocked), in ms and % of the step, with "
            "the collectives per step; source 'measured steps' (clocked "
            "during the median measured step, every engine, on CPU), 'profiler' (the trace of extra profiled "
            "steps: GPU and older runs) or 'instrumented' (the engine's own counters); the clocked share of the "
            "measured median: the clocked parts' sum over it, which nothing closes (a step more than 10% off the "
            "median, or clocked parts above 110% of it: not used by Why). Then why the fastest of them beats the "
            "others, where the measured steps tell them apart."
        ],
    )
    shown = 0
    for name, rs in by_sweep(rows).items():
        picked = [r for r in ranked(rs, metric) if r.step_breakdown][:8]
        if not picked or shown >= MAX_SWEEP_FIGS:
            continue
        labels = [r.label for r in picked]
        keys = components([r.step_breakdown for r in picked])
        s.images.append(
            (
                f"breakdown-{shown}",
                plots.stacked(
                    labels,
                    [r.step_breakdown.parts for r in picked],
                    f"{name}: where the step goes",
                    scale=1.0,
                    names={k: component_title(k) for k in keys},
                    xlabel="ms per step, mean over ranks (the table's source column says which steps)",
                ),
                f"stacked bars from zero of the time breakdown per layout in {name}",
            )
        )
        shown += 1
        s.tables.append(
            Table(
                ["layout", "source"]
                + [component_title(k) for k in keys]
                + ["step", "clocked share of the median", "collectives"],
                [
                    [r.label, r.step_breakdown.source]
                    + [ms_share(r.step_breakdown, k) for k in keys]
                    + [f"{r.step_breakdown.step_ms:.1f} ms", against_median(r.step_breakdown, r.step_time_median_s)]
                    + [_collectives_text(r.collectives)]
                    for r in picked
                ],
                name,
            )
        )
        engines, layouts = comparisons(why_cases(picked), limit=MAX_WHY)
        s.text += [
            f"{name}, why (the same layout under other engines): "
            + (" ".join(engines) or "no layout among these ran under two engines."),
            f"{name}, why (the same engine at other layouts): "
            + (" ".join(layouts) or "no engine among these ran two layouts."),
        ]
    if not shown:
        s.text.append("No run recorded a time breakdown.")
    return s


MAX_WHY = 6
HARNESS_AXIS = "harness"  # profiling.analysis.HARNESS: the harness's own loss reduction, not the engine's


def components(breakdowns: list) -> list[str]:
    """Every component of the breakdowns, in the order they are stacked (data.COMPONENTS)."""
    keys = {k for b in breakdowns for k in b.parts}
    return sorted(keys, key=lambda k: (COMPONENTS.index(k) if k in COMPONENTS else len(COMPONENTS), k))


def ms_share(b, key: str) -> str:
    """A component's cell: ms and % of the step, '-' where the run has no such component."""
    if key not in b.parts:
        return "-"
    share = b.share(key)
    return f"{b.parts[key]:.1f} ms" + (f" ({100 * share:.0f}%)" if share is not None else "")


def _collectives_text(found) -> str:
    if not found:
        return "not measured"
    coll, _ = found
    return (
        "; ".join(
            f"{c.get('axis')} {c.get('kind')} x{c.get('count')} ({(c.get('bytes') or 0) / 2**20:,.1f} MiB)"
            for c in coll
            if c.get("axis") != HARNESS_AXIS
        )
        or "none"
    )


def why_cases(rows: list[Row], label=None) -> list[Case]:
    return [
        Case(
            label(r) if label else r.label,
            r.variant,
            r.layout_key,
            r.step_time_median_s,
            r.step_breakdown,
            _ci(r),
            r.values.get("router_imbalance"),
            r.step_times or None,
            fields=factors(r.layout) if r.layout else None,
        )
        for r in rows
        if r.status == "ok" and r.step_breakdown and not r.oversubscribed  # its times explain nothing
    ]


def _ci(r: Row) -> tuple | None:
    ci = r.step_time_ci95_s
    return (float(ci[0]), float(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None


def ablation_why(rows: list[Row], metric: Metric, key, axis_name: str, rest) -> list[str]:
    """For one ablation: per other value of the axis, its best run that has a twin (the same `rest` of
    the layout) at the winning value, against that twin, naming the component that moved; where no
    twin ran, the two values' best runs (said so)."""
    best = best_per(rows, metric, key)
    if len(best) < 2:
        return []
    order = ranked(rows, metric)
    winner = key(order[0])
    twins: dict = {}
    for r in order:
        if key(r) == winner:
            twins.setdefault(rest(r), r)
    out = []
    for v in sorted((v for v in best if v != winner), key=sort_key):
        pair = next(((twins[rest(r)], r) for r in order if key(r) == v and rest(r) in twins), None)
        note = "" if pair else " (no run with the same other settings: the best runs of both)"
        w, other = pair or (best[winner], best[v])
        if not (w.step_breakdown and other.step_breakdown):
            out.append(f"{axis_name} {v} against {winner}: not measured (no step breakdown){note}.".lstrip())
            continue
        fast = why_cases([w], lambda r: f"{axis_name} {winner} ({r.label})".lstrip())[0]
        slow = why_cases([other], lambda r, v=v: f"{axis_name} {v} ({r.label})".lstrip())[0]
        out.append(explain(fast, slow)[:-1] + note + ".")
    return out
