"""Rows -> report sections: tables, figures and recommendations computed from the data.

Every section exists in every report; where the data cannot support it (the sweep did not
vary that axis, no run recorded a breakdown) the section says so instead of disappearing,
so a reader knows it was looked for. Rankings use one metric (data.choose_metric).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from harness.parallel_dims import ParallelDims
from harness.report import plots
from harness.report.breakdown import ablation_why
from harness.report.data import Metric, Row, coverage_label, fmt_s, interval_name, values_coverage
from harness.report.ranking import (
    MAX_FAILED_ROWS,
    MAX_SWEEP_FIGS,
    TOP,
    best_per,
    by_sweep,
    metric_ci,
    ranked,
    run_columns,
    sort_key,
    with_unit,
)
from harness.report.sections import Section, Table, table
from harness.store import STATUSES

# ---------------------------------------------------------------- sections

FREE = (
    " Each row is the best run with that value, whatever its other settings: not a like-for-like "
    "comparison (the recommendations compare runs that differ in this field alone)."
)


def overview(rows: list[Row], metric: Metric, peaks: dict[str, float] | None = None) -> Section:
    s = Section("overview", "Overview")
    sweeps = by_sweep(rows)
    s.text.append(
        f"{len(rows)} runs in {len(sweeps)} sweep(s). Layouts are ranked by {metric.title}. "
        "Step times are medians over the measured steps (warm-up excluded), with the interval of the median "
        "(distribution-free order statistics, at the coverage they have: "
        f"{coverage_label([values_coverage(r.values) for r in rows if r.status == 'ok'])}). "
        "MFU is PaLM's convention (the study's); MFU megatron and HFU (counting "
        "recomputation) are the same run under other FLOP conventions. "
        + (
            "MFU vs measured matmul divides every run by one peak per device, the highest matmul rate any run "
            "of this report measured on it ("
            + ", ".join(f"{tf:.3f} TFLOP/s on {dev or 'an unnamed device'}" for dev, tf in sorted(peaks.items()))
            + "): each run's own microbenchmark moved with the machine's load."
            if peaks
            else "No run measured a matmul peak, so there is no MFU vs measured matmul."
        )
    )
    table = []
    for name, rs in sweeps.items():
        st = Counter(r.status for r in rs)
        models = sorted({f"{r.model} seq {r.seq_len} batch {r.global_batch_size} {r.precision}" for r in rs})
        hw = sorted({f"{r.gpus} x {r.device}" for r in rs if r.device}) or ["?"]
        table.append([name, "; ".join(models), "; ".join(hw), str(len(rs))] + [str(st.get(k, 0)) for k in STATUSES])
    s.tables.append(Table(["sweep", "workload", "devices", "runs", *STATUSES], table))
    hosts = sorted({h for r in rows for h in r.hosts})
    versions = sorted({v for r in rows for v in r.versions})
    if hosts or versions:
        s.text.append(
            f"Hosts: {', '.join(hosts[:12]) or '-'}{' ...' if len(hosts) > 12 else ''}. "
            f"Software: {', '.join(versions) or '-'}."
        )
    over = [r for r in rows if r.status == "ok" and r.oversubscribed]
    if over:
        s.text.append(
            f"{len(over)} run(s) ran more busy threads (processes x threads) than their machine's usable cores: "
            "oversubscribed, so their step times measure CPU contention as much as the layout; they are not "
            "ranked, compared or explained (runs " + ", ".join(r.run_id[:10] for r in over[:12]) + ")."
        )
    if len({r.versions for r in rows if r.status == "ok"}) > 1:
        s.text.append("Warning: the runs differ in library versions; compare with care.")
    return s


def best_layouts(rows: list[Row], metric: Metric) -> Section:
    s = Section("best", "Best layouts")
    for name, rs in by_sweep(rows).items():
        top = ranked(rs, metric)[:TOP]
        if top:
            s.tables.append(table(run_columns(rows), top, f"{name}: the {len(top)} best of {len(rs)} runs"))
    if not s.tables:
        s.text.append("No run finished ok, so nothing can be ranked.")
    return s


def axis_section(
    rows: list[Row],
    metric: Metric,
    sid: str,
    title: str,
    key,
    axis_name: str,
    intro: str,
    plot: str = "bars",
    subset=None,
    rest=None,
) -> Section:
    """Best layout per value of one axis, per sweep: the study's way of showing an ablation. With
    `rest` (what else names a layout), also which component of the step moved (ablation_why)."""
    s = Section(sid, title, [intro + FREE])
    series: dict[str, list[tuple]] = {}
    covered: dict[str, list] = {}  # per series, its runs' interval coverages (the figure names them)
    shown = 0
    for name, rs in by_sweep(rows).items():
        if subset:
            rs = [r for r in rs if subset(r)]
        values = {key(r) for r in rs}
        if len(values) < 2:
            continue
        best = best_per(rs, metric, key)
        status = defaultdict(Counter)
        for r in rs:
            status[key(r)][r.status] += 1
        table = []
        for v in sorted(values, key=sort_key):
            b = best.get(v)
            counts = ", ".join(f"{k} {n}" for k, n in sorted(status[v].items()))
            table.append(
                [
                    str(v),
                    metric.fmt(metric.of(b)) if b else "-",
                    fmt_s(b.step_time_median_s) if b else "-",
                    b.label if b else "(no run ok)",
                    counts,
                ]
            )
        s.tables.append(Table([axis_name, "best " + metric.short, "step", "best layout", "runs"], table, name))
        moved = ablation_why(rs, metric, key, axis_name, rest) if rest else []
        if moved:
            s.text.append(f"{name}, what moved: " + " ".join(moved))
        if best:
            series[name] = [(v, metric.of(b), *(metric_ci(b, metric) or (None, None))) for v, b in best.items()]
            covered[name] = [values_coverage(b.values) for b in best.values() if metric_ci(b, metric)]
            if plot == "bars" and shown < MAX_SWEEP_FIGS:
                labels = sorted(best, key=sort_key)
                s.images.append(
                    (
                        f"{sid}-{shown}",
                        plots.bars(
                            [str(v) for v in labels],
                            [metric.of(best[v]) for v in labels],
                            f"{name}: best per {axis_name}",
                            metric.short,
                            metric.percent,
                            [metric_ci(best[v], metric) for v in labels],
                            interval_name(values_coverage(best[v].values) for v in labels),
                        ),
                        f"best {metric.short} per {axis_name} in {name}",
                    )
                )
                shown += 1
    if plot == "lines" and series:
        s.images.append(
            (
                sid,
                plots.lines(
                    dict(list(series.items())[:MAX_SWEEP_FIGS]),
                    axis_name,
                    metric.short,
                    f"best layout per {axis_name}",
                    metric.percent,
                    interval_name(c for n in list(series)[:MAX_SWEEP_FIGS] for c in covered[n]),
                ),
                f"best {metric.short} against {axis_name}",
            )
        )
    if not s.tables:
        s.text.append(f"No sweep varied {axis_name} among comparable runs, so there is nothing to compare.")
    return s


def _tp_pp(r: Row) -> int:
    """The ranks (GPUs, or CPU processes) a run's tensor and pipeline degrees span (TP against PP compares
    runs at equal)."""
    return ParallelDims(tp=r.tp, pp=r.pp).product("tp", "pp")


def tp_pp(rows: list[Row], metric: Metric) -> Section:
    s = Section(
        "tp-pp",
        "Tensor x pipeline parallelism",
        [
            "Best result per (tp, pp) cell over all other settings; a cell where nothing ran ok "
            "shows the most frequent failure."
        ],
    )
    shown = 0
    for name, rs in by_sweep(rows).items():
        if len({(r.tp, r.pp) for r in rs}) < 2:
            continue
        best = best_per(rs, metric, lambda r: (r.tp, r.pp))
        cells: dict = {k: metric.of(v) for k, v in best.items()}
        for r in rs:
            if (r.tp, r.pp) not in cells:
                fails = Counter(x.status for x in rs if (x.tp, x.pp) == (r.tp, r.pp))
                cells[(r.tp, r.pp)] = fails.most_common(1)[0][0].upper()
        tps, pps = sorted({k[0] for k in cells}), sorted({k[1] for k in cells})
        table = [
            [f"pp {pp}"]
            + [
                (
                    metric.fmt(cells[(tp, pp)])
                    if isinstance(cells.get((tp, pp)), float)
                    else str(cells.get((tp, pp), ""))
                )
                for tp in tps
            ]
            for pp in pps
        ]
        s.tables.append(Table([""] + [f"tp {t}" for t in tps], table, f"{name}: best {metric.short} per cell"))
        for g in sorted({_tp_pp(r) for r in rs if _tp_pp(r) > 1}):
            moved = ablation_why(
                [r for r in rs if _tp_pp(r) == g],
                metric,
                lambda r: f"tp{r.tp} pp{r.pp}",
                "",
                lambda r: (r.variant, r.context, r.dp, r.micro_batch_size, r.activation_checkpointing, r.kernel),
            )
            if moved:
                s.text.append(f"{name}, TP against PP at {g} model-parallel ranks, what moved: " + " ".join(moved))
        if shown < MAX_SWEEP_FIGS:
            s.images.append(
                (
                    f"tp-pp-{shown}",
                    plots.heatmap(cells, f"{name}: best per tp x pp", metric.percent),
                    f"heatmap of best {metric.short} per tp and pp in {name}",
                )
            )
            shown += 1
    if not s.tables:
        s.text.append("No sweep varied tp or pp.")
    return s


def pipeline(rows: list[Row], metric: Metric, run_id: str | None = None) -> Section:
    """The chosen run's schedule (by run id prefix), else the best pipelined run's."""
    s = Section("timeline", "Pipeline schedule of one step")
    cands = [r for r in ranked(rows, metric) if r.timeline and r.pp > 1]
    if run_id:
        chosen = [r for r in rows if r.run_id.startswith(run_id) and r.timeline]
        if not chosen:
            s.text.append(f"Run {run_id} has no recorded pipeline schedule; showing the best pipelined run.")
        cands = chosen + cands
    if not cands:
        s.text.append("No run with pipeline parallelism recorded its schedule.")
        return s
    r = cands[0]
    bad = [e for e in r.timeline if not {"start_s", "end_s"} <= set(e)]
    if bad:
        s.text.append("The recorded schedule lacks start/end times; not drawn.")
        return s
    s.text.append(
        f"{'The chosen' if run_id and r.run_id.startswith(run_id) else 'The best pipelined'} run: "
        f"{r.label} ({r.sweep}, run {r.run_id[:10]}). Forward (F) and "
        "backward (B) passes per micro-batch and stage"
        + (
            ", the weight gradients (W) apart where the schedule splits the backward"
            if any(e.get("kind") == "W" for e in r.timeline)
            else ""
        )
        + "; the white space is the pipeline bubble (on that stage: waiting for its neighbours)."
    )
    stages = sorted({e.get("stage", 0) for e in r.timeline})
    if len(stages) > r.pp:
        s.text.append(
            f"Each of the {r.pp} pipeline ranks holds {len(stages) // r.pp} of the {len(stages)} stages: a rank "
            "waits only where none of its stages computes."
        )
    if len(stages) < r.pp:
        s.text.append(f"The run recorded stage(s) {', '.join(map(str, stages))} of {r.pp} only.")
    s.images.append(("timeline", plots.timeline(r.timeline, r.label), "pipeline timeline of one step"))
    return s


def failures(rows: list[Row]) -> Section:
    s = Section("failures", "Failed runs")
    bad = [r for r in rows if r.status != "ok"]
    if not bad:
        s.text.append("Every run finished ok.")
        return s
    c = Counter(r.status for r in bad)
    s.text.append(
        "Status counts: "
        + ", ".join(f"{k} {n}" for k, n in c.most_common())
        + ". oom: the run raised CUDA out-of-memory; failed: another error (excerpt below); "
        "timeout: killed after the per-run limit."
    )
    shown = sorted(bad, key=lambda r: (r.sweep, r.status, r.label))[:MAX_FAILED_ROWS]
    s.tables.append(
        Table(
            ["sweep", "status", "layout", "reason", "run"],
            [[r.sweep, r.status, r.label, r.reason or "-", r.run_id[:10]] for r in shown],
            f"{len(shown)} of {len(bad)} shown" if len(bad) > len(shown) else "",
        )
    )
    return s


def quoted(rows: list[Row], metric: Metric, base: dict) -> Section:
    s = Section(
        "baselines",
        "Measured against quoted",
        [
            "QUOTED figures come from publications (source in each row); MEASURED figures are runs in "
            "this store. They are comparable only where model, sequence length, batch and hardware "
            "agree, which the table states."
        ],
    )
    study = base.get("study") or []
    if study:
        table = []
        for b in study:
            same = [r for r in ranked(rows, metric) if r.model == b["harness_model"] and str(r.seq_len) == b["seq_len"]]
            # prefer the same GPU count and batch; a stable sort keeps the ranking within each group
            same.sort(key=lambda r: (str(r.gpus) != b["gpus"], str(r.global_batch_size) != b["global_batch_size"]))
            m = same[0] if same else None
            meas = "no measured run of this model and sequence length"
            if m:
                meas = f"MEASURED {with_unit(metric, metric.of(m))} on {m.gpus} x {m.device or '?'}: {m.label}"
                diffs = [
                    d
                    for d, bad in (
                        ("GPU count", str(m.gpus) != b["gpus"]),
                        ("global batch", str(m.global_batch_size) != b["global_batch_size"]),
                        ("GPU type", "A100" not in m.device or "80" not in m.device),
                        ("metric", metric.key != "mfu"),
                    )
                    if bad
                ]
                if diffs:
                    meas += f" (not comparable: different {', '.join(diffs)})"
            table.append(
                [
                    b["model"],
                    f"{b['gpus']} x A100 80GB",
                    f"seq {b['seq_len']}, batch {b['global_batch_size']}",
                    f"QUOTED {100 * float(b['mfu']):.1f}%",
                    f"tp{b['tp']} pp{b['pp']} mb{b['micro_batch_size']} ckpt {b['activation_checkpointing']} "
                    f"{b['kernel']}" + (" sp" if b.get("sequence_parallel") == "True" else ""),
                    meas,
                    f"{b['source_file']} ({b['runs_ok']} ok / {b['runs']} runs)",
                ]
            )
        s.tables.append(
            Table(
                [
                    "model",
                    "hardware",
                    "workload",
                    "study's best MFU",
                    "study's best layout",
                    "measured here",
                    "source data",
                ],
                table,
                "Source: " + study[0]["source"] + "; data licence " + study[0]["license"],
            )
        )
    fw = base.get("frameworks") or []
    if fw:
        s.tables.append(
            Table(
                ["framework", "model", "devices", "hardware", "seq", "QUOTED MFU", "convention", "source"],
                [
                    [
                        f["framework"],
                        f["model"],
                        f["devices"],
                        f["hardware"],
                        f["seq_len"],
                        f"{100 * float(f['mfu']):.1f}%",
                        f["convention"],
                        f"{f['source']}, {f['location']}",
                    ]
                    for f in fw
                ],
                "Other training stacks, as published",
            )
        )
    best = ranked(rows, metric)
    if best:
        s.tables.append(
            Table(
                ["sweep", "MEASURED best", "layout", "devices"],
                [
                    [n, with_unit(metric, metric.of(b[0])), b[0].label, f"{b[0].gpus} x {b[0].device or '?'}"]
                    for n, b in ((n, ranked(rs, metric)) for n, rs in by_sweep(rows).items())
                    if b
                ],
                "Measured in this store",
            )
        )
    if not study and not fw:
        s.text.append("No baselines directory was found (pass --baselines DIR).")
    return s
