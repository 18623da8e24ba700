"""What the sweep report's sections share: rows grouped by sweep, ranked by the report's metric,
the best run per key, the runs that differ in one field alone, the run table's columns, a figure
with its unit and a rate's confidence interval."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from harness.report.data import Metric, Row, measured_columns
from harness.report.sections import Column
from harness.spec.schema import Layout

_DEFAULT_LAYOUT = dataclasses.asdict(Layout())  # what an old record's partial layout leaves out

TOP = 10
MAX_SWEEP_FIGS = 6
MAX_FAILED_ROWS = 60


def by_sweep(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[r.sweep].append(r)
    return dict(out)


def ranked(rows: list[Row], metric: Metric) -> list[Row]:
    """The ok runs by the metric, best first; an oversubscribed run's times rank nothing (data.RowOwn)."""
    ok = [r for r in rows if r.status == "ok" and not r.oversubscribed and metric.of(r) is not None]
    return sorted(ok, key=lambda r: -metric.of(r))


def best_per(rows: list[Row], metric: Metric, key) -> dict:
    """value of key(row) -> the best ok row with that value."""
    best: dict = {}
    for r in ranked(rows, metric):
        best.setdefault(key(r), r)
    return best


def with_unit(metric: Metric, value) -> str:
    """A figure of the ranking metric with its unit: '5,287 tokens/s per device', '41.2% MFU'."""
    return "-" if value is None else f"{metric.fmt(value)} {metric.short}"


def other_fields(r: Row, drop: tuple[str, ...]) -> tuple:
    """Every layout and workload field of a run but `drop` (the fields an ablation varies; a workload
    field as `workload.<name>`), and but those that do nothing at its degrees (a schedule without a
    pipeline, a cp implementation without cp, an FP8 recipe without FP8): two runs with the same
    tuple differ in the dropped fields alone (a sweep may vary workload.precision beside the layout)."""
    lay = {**_DEFAULT_LAYOUT, **r.layout}
    inert = set(drop)
    if int(lay.get("pp") or 1) == 1 and int(lay.get("virtual_stages") or 1) == 1:
        inert |= {"pipeline_schedule", "pipeline_p2p", "virtual_stages"}
    if int(lay.get("cp") or 1) == 1:
        inert.add("cp_impl")
    if r.workload.get("precision") != "fp8":
        inert.add("workload.fp8_recipe")
    named = {**lay, **{f"workload.{k}": v for k, v in r.workload.items()}}
    return tuple((k, repr(v)) for k, v in sorted(named.items()) if k not in inert)


def matched(rows: list[Row], metric: Metric, key, drop: tuple[str, ...]) -> list[tuple[str, dict]]:
    """Per sweep, the groups of ok runs equal in every layout field but `drop` that hold two or more
    values of key(run): [(sweep, {value: the group's best run with it})], the like-for-like
    comparisons an ablation may draw."""
    out = []
    for sweep, rs in by_sweep(rows).items():
        groups: dict = defaultdict(list)
        for r in ranked(rs, metric):
            groups[other_fields(r, drop)].append(r)
        out += [(sweep, best) for best in (best_per(g, metric, key) for g in groups.values()) if len(best) > 1]
    return out


def uses_cp(rows: list[Row]) -> bool:
    """Whether any run has context parallelism: only then do the tables and ablations name it."""
    return any(r.cp > 1 for r in rows)


def uses_ep(rows: list[Row]) -> bool:
    """Whether any run shares out a MoE's experts: only then do the tables and ablations name ep."""
    return any(r.ep > 1 for r in rows)


def run_columns(rows: list[Row] = ()) -> list[Column]:
    """The sweep's table of runs: what names a run's layout, every reported measurement, the run id;
    cp and its implementation only where one of `rows` uses it."""
    cp = [Column("cp", lambda r: str(r.cp)), Column("cp impl", lambda r: r.cp_impl or "-")] if uses_cp(rows) else []
    return [
        Column("engine", lambda r: r.variant),
        Column("tp", lambda r: str(r.tp)),
        *cp,
        Column("pp", lambda r: str(r.pp)),
        Column("dp", lambda r: str(r.dp)),
        *([Column("ep", lambda r: str(r.ep))] if uses_ep(rows) else []),
        Column("mb", lambda r: str(r.micro_batch_size)),
        Column("ckpt", lambda r: r.activation_checkpointing),
        Column("kernels", lambda r: r.kernel),
        Column("sp", lambda r: "yes" if r.sequence_parallel else "no"),
        *measured_columns(lambda r: r.values),
        Column("run", lambda r: r.run_id[:10]),
    ]


def rate_ci(value, step_median, step_ci) -> tuple[float, float] | None:
    """The interval of a rate taken at the median step time (MFU, tokens/s: a constant divided by
    the median step), from the interval of that median: it maps through 1/x, its ends swapped, and
    keeps its coverage. One definition of the interval everywhere: measure.stats.median_interval (the
    order statistics whose exact coverage reaches 95%: at 8 steps the range, 99.2%; below 6 steps the
    range, under 95%), in the record as step_time_s.ci95_low/high with ci_coverage. Two runs are told
    apart by the ratio of their step times (measure.stats.compare_times), not by these intervals."""
    if value is None or not step_median or not step_ci or None in step_ci or min(step_ci) <= 0:
        return None
    return value * step_median / max(step_ci), value * step_median / min(step_ci)


def metric_ci(r: Row, metric: Metric) -> tuple[float, float] | None:
    """The interval of a run's ranking metric (rate_ci): the median's, at its coverage."""
    return rate_ci(metric.of(r), r.step_time_median_s, r.step_time_ci95_s)


def sort_key(v):
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))
