"""What the sweep report's sections share: rows grouped by sweep, ranked by the report's metric,
the best run per key, the run table's columns and a rate's confidence interval."""

from __future__ import annotations

from collections import defaultdict

from harness.report.data import Metric, Row, measured_columns
from harness.report.sections import Column

TOP = 10
MAX_SWEEP_FIGS = 6
MAX_FAILED_ROWS = 60


def by_sweep(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        out[r.sweep].append(r)
    return dict(out)


def ranked(rows: list[Row], metric: Metric) -> list[Row]:
    ok = [r for r in rows if r.status == "ok" and metric.of(r) is not None]
    return sorted(ok, key=lambda r: -metric.of(r))


def best_per(rows: list[Row], metric: Metric, key) -> dict:
    """value of key(row) -> the best ok row with that value."""
    best: dict = {}
    for r in ranked(rows, metric):
        best.setdefault(key(r), r)
    return best


def uses_cp(rows: list[Row]) -> bool:
    """Whether any run has context parallelism: only then do the tables and ablations name it."""
    return any(r.cp > 1 for r in rows)


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
        Column("mb", lambda r: str(r.mb)),
        Column("ckpt", lambda r: r.ckpt),
        Column("kernels", lambda r: r.kernel),
        Column("sp", lambda r: "yes" if r.sp else "no"),
        *measured_columns(lambda r: r.values),
        Column("run", lambda r: r.run_id[:10]),
    ]


def rate_ci(value, step_median, step_ci) -> tuple[float, float] | None:
    """The 95% CI of a rate taken at the median step time (MFU, tokens/s: a constant divided by
    the median step), from the CI of that median: the interval maps through 1/x, its ends
    swapped. One definition of the interval everywhere: measure.median_ci95, in the record as
    step_time_s.ci95_low/high."""
    if value is None or not step_median or not step_ci or None in step_ci or min(step_ci) <= 0:
        return None
    return value * step_median / max(step_ci), value * step_median / min(step_ci)


def metric_ci(r: Row, metric: Metric) -> tuple[float, float] | None:
    """The 95% CI of a run's ranking metric (rate_ci)."""
    return rate_ci(metric.of(r), r.step_median, r.step_ci)


def sort_key(v):
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))
