"""Recommendations computed from the rows, each with the evidence rows it rests on.

The rule: a sentence is only produced when the data has a comparison to make (the axis
varied in at least one sweep and at least two values ran ok); its wording states the count
("in 3 of 4 sweeps") and the evidence table lists, per sweep, the best run for each value.
Differences under NOISE are called a tie: repeated identical runs differ by about 1%.
"""

from __future__ import annotations

from harness.report.data import Metric, Row, fmt_s
from harness.report.ranking import best_per, by_sweep, ranked
from harness.report.sections import Section, Table

NOISE = 0.01  # relative: below this the winner is not distinguishable from the runner-up

AXES = [
    ("micro-batch size", lambda r: r.mb, None),
    ("activation checkpointing", lambda r: r.ckpt, None),
    ("attention+rmsnorm kernels", lambda r: r.kernel, None),
    ("sequence parallelism (tp > 1 only)", lambda r: "on" if r.sp else "off", lambda r: r.tp > 1),
    ("context parallelism", lambda r: r.context, None),
    ("engine", lambda r: r.variant, None),
]


def doubt(win: Row, other: Row, metric: Metric) -> str | None:
    """Why the winner's lead may not be real (None: it is): under NOISE, or overlapping CIs."""
    if metric.of(win) / metric.of(other) - 1 < NOISE:
        return "under the ~1% run-to-run noise"
    if win.step_ci and other.step_ci and None not in win.step_ci + other.step_ci and win.step_ci[1] >= other.step_ci[0]:
        return "the step-time 95% confidence intervals overlap"
    return None


def _axis(rows: list[Row], metric: Metric, name: str, key, subset) -> tuple[str, Table] | None:
    wins, evidence, sweeps = {}, [], 0
    for sweep, rs in by_sweep(rows).items():
        if subset:
            rs = [r for r in rs if subset(r)]
        best = best_per(rs, metric, key)
        if len(best) < 2:
            continue
        sweeps += 1
        order = sorted(best.items(), key=lambda kv: -metric.of(kv[1]))
        (win, wrow), (_, second) = order[0], order[1]
        wins.setdefault(win, []).append((sweep, metric.of(wrow) / metric.of(second) - 1, doubt(wrow, second, metric)))
        for v, r in order:
            evidence.append(
                [
                    sweep,
                    str(v),
                    metric.fmt(metric.of(r)),
                    fmt_s(r.step_median),
                    r.label,
                    "best" if v == win else f"{100 * (metric.of(r) / metric.of(wrow) - 1):+.1f}%",
                ]
            )
    if not sweeps:
        return None
    top, hits = max(wins.items(), key=lambda kv: len(kv[1]))
    margins = [m for _, m, _ in hits]
    span = f"{100 * margins[0]:.1f}%" if len(margins) == 1 else f"{100 * min(margins):.1f}-{100 * max(margins):.1f}%"
    text = f"{name}: {top} was best in {len(hits)} of {sweeps} sweep(s), by {span} over the runner-up"
    doubts = [d for *_, d in hits if d]
    if len(doubts) == len(hits) == 1:
        text += f", but {doubts[0]}: not a clear win."
    elif doubts:
        text += f"; in {len(doubts)} of these the lead is not clear ({'; '.join(sorted(set(doubts)))})."
    else:
        text += "."
    others = {k: len(v) for k, v in wins.items() if k != top}
    if others:
        text += " Elsewhere: " + ", ".join(f"{k} best in {n}" for k, n in others.items()) + "."
    return text, Table(["sweep", name, "best", "step", "layout", "vs winner"], evidence)


def _tp_vs_pp(rows: list[Row], metric: Metric) -> tuple[str, Table] | None:
    """Same model-parallel degree, split towards pipeline or towards tensor parallelism."""
    pp_wins, total, evidence = 0, 0, []
    for sweep, rs in by_sweep(rows).items():
        ok = ranked(rs, metric)
        tp_heavy = [r for r in ok if r.tp > r.pp]
        pp_heavy = [r for r in ok if r.pp > r.tp]
        if not tp_heavy or not pp_heavy:
            continue
        total += 1
        a, b = pp_heavy[0], tp_heavy[0]
        pp_wins += metric.of(a) > metric.of(b)
        evidence += [
            [sweep, "pipeline-heavier (pp > tp)", metric.fmt(metric.of(a)), a.label],
            [sweep, "tensor-heavier (tp > pp)", metric.fmt(metric.of(b)), b.label],
        ]
    if not total:
        return None
    text = (
        f"pipeline vs tensor parallelism: the best pipeline-heavier layout beat the best tensor-heavier "
        f"one in {pp_wins} of {total} sweep(s)."
    )
    return text, Table(["sweep", "split", "best", "layout"], evidence)


def _checkpointing_memory(rows: list[Row]) -> str | None:
    """Where checkpointing only 'wins' because the layout without it ran out of memory."""
    saved = 0
    for rs in by_sweep(rows).values():
        idx = {}
        for r in rs:
            idx.setdefault((r.variant, r.tp, r.context, r.pp, r.dp, r.mb, r.kernel, r.sp), {})[r.ckpt] = r.status
        saved += sum(
            1 for v in idx.values() if v.get("none") == "oom" and any(s == "ok" for k, s in v.items() if k != "none")
        )
    if saved:
        return (
            f"activation checkpointing made {saved} layout(s) fit that ran out of memory without it; "
            "elsewhere compare the ablation above."
        )
    return None


def recommendations(rows: list[Row], metric: Metric) -> Section:
    s = Section("recommendations", "Recommendations (derived from these runs)")
    s.text.append(
        "Each statement below is computed from the runs in this report; the table under it is "
        "its evidence (per sweep, the best run for each value). Nothing here is written in advance."
    )
    found = 0
    for got in [_axis(rows, metric, name, key, subset) for name, key, subset in AXES] + [_tp_vs_pp(rows, metric)]:
        if got:  # the statement is the caption of its evidence table
            s.tables.append(Table(got[1].headers, got[1].rows, got[0]))
            found += 1
    mem = _checkpointing_memory(rows)
    if mem:
        s.text.append(mem)
    if not found:
        s.text.append("Too few successful runs vary any axis to recommend anything.")
    return s
