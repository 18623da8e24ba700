"""Recommendations computed from the rows, each with the evidence rows it rests on.

The rule: an ablation compares only runs that differ in its one field, every other layout field
equal (ranking.matched); a sentence is only produced when the data has such a comparison to make,
and says so where the field varied but no two runs differ in it alone. Its wording states the count
("in 3 of 4 comparisons") and the evidence table lists every compared run. Differences under NOISE
are called a tie: repeated identical runs differ by about 1%. Every figure carries its unit.
"""

from __future__ import annotations

from harness.parallel_dims import ParallelDims
from harness.report.data import Metric, Row, coverage_label, fmt_s, values_coverage
from harness.report.ranking import by_sweep, matched, other_fields, ranked, with_unit
from harness.report.sections import Section, Table
from harness.spec.schema import BF16_PRECISIONS

NOISE = 0.01  # relative: below this the winner is not distinguishable from the runner-up

# The layout fields that name an engine and its own settings: the engine ablation compares runs
# equal in every other field.
ENGINE_FIELDS = ("engine", "zero_stage", "reshard_after_forward", "ds_config", "dp_bucket_mb", "model_impl", "ds_moe")

# (name, value of a run, which runs it applies to, the layout fields the value is made of)
AXES = [
    ("micro-batch size", lambda r: r.micro_batch_size, None, ("micro_batch_size",)),
    ("activation checkpointing", lambda r: r.activation_checkpointing, None, ("activation_checkpointing",)),
    ("attention+rmsnorm kernels", lambda r: r.kernel, None, ("attention", "rmsnorm")),
    (
        "sequence parallelism (tp > 1 only)",
        lambda r: "on" if r.sequence_parallel else "off",
        lambda r: r.tp > 1,
        ("sequence_parallel",),
    ),
    ("context parallelism", lambda r: r.context, None, ("cp", "cp_impl", "dp")),  # the GPUs fixed: dp shrinks
    ("expert parallelism", lambda r: r.expert, None, ("ep",)),  # carved from dp: the GPUs and dp stay
    ("engine", lambda r: r.variant, None, ENGINE_FIELDS),
    # the levers of today's training: FP8 GEMMs (a workload field), torch.compile, the schedule
    (
        "precision (bf16 or fp8)",
        lambda r: r.precision,
        lambda r: r.precision in BF16_PRECISIONS,
        ("workload.precision", "workload.fp8_recipe"),  # not fp8_all_gather: that is a second change
    ),
    ("torch.compile", lambda r: r.compiled, None, ("compile",)),
    (
        "pipeline schedule (pp > 1 only)",
        lambda r: r.schedule,
        lambda r: r.pp > 1,
        ("pipeline_schedule", "virtual_stages"),
    ),
]
# TP against PP: the same model-parallel ranks split the other way (sp and the schedule belong to one side)
SPLIT_FIELDS = ("tp", "pp", "sequence_parallel", "pipeline_schedule", "pipeline_p2p", "virtual_stages")


def doubt(win: Row, other: Row, metric: Metric) -> str | None:
    """Why the winner's lead may not be real (None: it is): under NOISE, or the ratio interval of the two
    runs' step times (measure.stats.compare_times) does not call the winner faster; runs recorded
    without step times: their medians' intervals overlap."""
    if metric.of(win) / metric.of(other) - 1 < NOISE:
        return "under the ~1% run-to-run noise"
    if win.step_times and other.step_times:
        from harness.measure.stats import compare_times, verdict_text

        d = compare_times(list(win.step_times), list(other.step_times))
        return None if d["verdict"] == "faster" else f"the step time ratio is {verdict_text(d)}"
    if (
        win.step_time_ci95_s
        and other.step_time_ci95_s
        and None not in win.step_time_ci95_s + other.step_time_ci95_s
        and win.step_time_ci95_s[1] >= other.step_time_ci95_s[0]
    ):
        return "the step-time intervals of the median overlap"
    return None


def _lead(metric: Metric, span: str) -> str:
    """'by 47.1% more tokens/s per device than the runner-up' (MFU: a relative margin, said so)."""
    relative = " (relative, not percentage points)" if metric.percent else ""
    return f"by {span} more {metric.short}{relative} than the runner-up"


def _varied(rows: list[Row], metric: Metric, key, subset) -> bool:
    """Whether some sweep has ok runs with two values of the field (a comparison was looked for)."""
    return any(
        len({key(r) for r in ranked(rs, metric) if not subset or subset(r)}) > 1 for rs in by_sweep(rows).values()
    )


def _axis(rows: list[Row], metric: Metric, name: str, key, subset, drop) -> tuple[str, Table | None] | None:
    """The value that won most comparisons of runs differing in this field alone, with its margin."""
    rows = [r for r in rows if not subset or subset(r)]
    groups = matched(rows, metric, key, drop)
    if not groups:
        if not _varied(rows, metric, key, subset):
            return None
        return (
            f"{name}: no two runs that finished differ in {name} alone (every other layout field equal), "
            "so no value is compared.",
            None,
        )
    wins, evidence = {}, []
    for i, (sweep, best) in enumerate(groups, 1):
        order = sorted(best.items(), key=lambda kv: -metric.of(kv[1]))
        (win, wrow), (_, second) = order[0], order[1]
        wins.setdefault(win, []).append((sweep, metric.of(wrow) / metric.of(second) - 1, doubt(wrow, second, metric)))
        for v, r in order:
            evidence.append(
                [
                    sweep,
                    f"#{i}",
                    str(v),
                    with_unit(metric, metric.of(r)),
                    fmt_s(r.step_time_median_s),
                    r.label,
                    "best" if v == win else f"{100 * (metric.of(r) / metric.of(wrow) - 1):+.1f}%",
                ]
            )
    top, hits = max(wins.items(), key=lambda kv: len(kv[1]))
    margins = [m for _, m, _ in hits]
    span = f"{100 * margins[0]:.1f}%" if len(margins) == 1 else f"{100 * min(margins):.1f}-{100 * max(margins):.1f}%"
    sweeps = len({s for s, _ in groups})
    text = (
        f"{name}: {top} was best in {len(hits)} of {len(groups)} comparison(s) of runs that differ in {name} "
        f"alone (every other layout field equal; {sweeps} sweep(s)), {_lead(metric, span)}"
    )
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
    headers = ["sweep", "comparison", name, metric.short, "step", "layout", "vs best of its comparison"]
    return text, Table(headers, evidence)


def decided_faster(a: Row, b: Row) -> Row | None:
    """The run whose step time is decidedly shorter, or None where the two are not distinguishable: their
    step-time intervals of the median overlap, or they differ by less than NOISE. The one
    call site to switch to an interval on the ratio of the two runs' step times once measure.stats has it."""
    fast, slow = sorted((a, b), key=lambda r: r.step_time_median_s or float("inf"))
    if not fast.step_time_median_s or not slow.step_time_median_s:
        return None
    if slow.step_time_median_s / fast.step_time_median_s - 1 < NOISE:
        return None
    ci_f, ci_s = fast.step_time_ci95_s, slow.step_time_ci95_s
    if ci_f and ci_s and None not in (*ci_f, *ci_s) and ci_f[1] >= ci_s[0]:
        return None
    return fast


def _tp_vs_pp(rows: list[Row], metric: Metric) -> tuple[str, Table | None] | None:
    """Same model-parallel ranks (tp x pp), split towards pipeline or towards tensor parallelism, every
    other layout field equal but those that belong to one side (sequence parallelism needs tp > 1, a pipeline
    schedule pp > 1: each side's best over them); counted only where the difference is decided."""
    pp_wins, tp_wins, total, evidence = 0, 0, 0, []
    split = [r for r in rows if r.tp != r.pp]
    for sweep, rs in by_sweep(split).items():
        groups: dict = {}
        for r in ranked(rs, metric):
            groups.setdefault(
                (ParallelDims(tp=r.tp, pp=r.pp).product("tp", "pp"), other_fields(r, SPLIT_FIELDS)), {}
            ).setdefault(r.pp > r.tp, r)
        for pair in groups.values():
            if len(pair) < 2:
                continue
            total += 1
            a, b = pair[True], pair[False]
            won = decided_faster(a, b)
            pp_wins, tp_wins = pp_wins + (won is a), tp_wins + (won is b)
            call = "not distinguishable" if won is None else ("decided: " + ("pipeline" if won is a else "tensor"))
            evidence += [
                [
                    sweep,
                    f"#{total}",
                    "pipeline-heavier (pp > tp)",
                    with_unit(metric, metric.of(a)),
                    _ci(a),
                    a.label,
                    call,
                ],
                [
                    sweep,
                    f"#{total}",
                    "tensor-heavier (tp > pp)",
                    with_unit(metric, metric.of(b)),
                    _ci(b),
                    b.label,
                    call,
                ],
            ]
    if not total:
        if not any(r.tp > r.pp for r in ranked(split, metric)) or not any(r.pp > r.tp for r in ranked(split, metric)):
            return None
        return (
            "pipeline vs tensor parallelism: no pipeline-heavier and tensor-heavier runs that finished share the "
            "model-parallel ranks and every other layout field, so the split is not compared.",
            None,
        )
    undecided = total - pp_wins - tp_wins
    text = (
        f"pipeline vs tensor parallelism: of {total} comparison(s) of the best pipeline-heavier layout (any "
        "pipeline schedule) against the best tensor-heavier one (with or without sequence parallelism) on the "
        f"same model-parallel ranks, every other layout field equal, the pipeline-heavier was decidedly faster "
        f"in {pp_wins}, the tensor-heavier in {tp_wins}, and {undecided} were not distinguishable (the step-time "
        f"intervals of the median overlap, or under the ~{100 * NOISE:.0f}% run-to-run noise)."
    )
    headers = [
        "sweep",
        "comparison",
        "split",
        metric.short,
        "step [interval of the median] (coverage)",
        "layout",
        "difference",
    ]
    return text, Table(headers, evidence)


def _ci(r: Row) -> str:
    ci = r.step_time_ci95_s
    cov = coverage_label([values_coverage(r.values)])
    shown = f" [{fmt_s(ci[0])}, {fmt_s(ci[1])}] ({cov})" if ci and None not in ci else ""
    return fmt_s(r.step_time_median_s) + shown


def _checkpointing_memory(rows: list[Row]) -> str | None:
    """Where checkpointing only 'wins' because the layout without it ran out of memory."""
    saved = 0
    for rs in by_sweep(rows).values():
        idx = {}
        for r in rs:
            idx.setdefault(other_fields(r, ("activation_checkpointing",)), {})[r.activation_checkpointing] = r.status
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
        "its evidence: the runs compared, in comparisons (#) of runs that differ in that field alone, every "
        "other layout field equal (pipeline against tensor parallelism: as its statement says). Nothing here "
        "is written in advance."
    )
    found = 0
    for got in [_axis(rows, metric, *axis) for axis in AXES] + [_tp_vs_pp(rows, metric)]:
        if got and got[1] is None:  # the field varied, but never alone
            s.text.append(got[0])
        elif got:  # the statement is the caption of its evidence table
            s.tables.append(Table(got[1].headers, got[1].rows, got[0]))
            found += 1
    mem = _checkpointing_memory(rows)
    if mem:
        s.text.append(mem)
    if not found:
        s.text.append("Too few successful runs vary any axis alone to recommend anything.")
    return s
