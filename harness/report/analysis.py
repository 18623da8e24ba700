"""Rows -> report sections: tables, figures and recommendations computed from the data.

Every section exists in every report; where the data cannot support it (the sweep did not
vary that axis, no run recorded a breakdown) the section says so instead of disappearing,
so a reader knows it was looked for. Rankings use one metric (data.choose_metric).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from harness.parallel_dims import ParallelDims
from harness.report import plots
from harness.report.data import COMPONENTS, Metric, Row, component_title, fmt_s, measured_columns
from harness.report.sections import Column, Section, Table, table
from harness.report.why import Case, comparisons, explain
from harness.store import STATUSES

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
    return [Column("engine", lambda r: r.variant), Column("tp", lambda r: str(r.tp)), *cp,
            Column("pp", lambda r: str(r.pp)), Column("dp", lambda r: str(r.dp)), Column("mb", lambda r: str(r.mb)),
            Column("ckpt", lambda r: r.ckpt), Column("kernels", lambda r: r.kernel),
            Column("sp", lambda r: "yes" if r.sp else "no"), *measured_columns(lambda r: r.values),
            Column("run", lambda r: r.run_id[:10])]


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


def _sort_key(v):
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))


# ---------------------------------------------------------------- sections

def overview(rows: list[Row], metric: Metric) -> Section:
    s = Section("overview", "Overview")
    sweeps = by_sweep(rows)
    s.text.append(f"{len(rows)} runs in {len(sweeps)} sweep(s). Layouts are ranked by {metric.title}. "
                  "Step times are medians over the measured steps (warm-up excluded), with a 95% "
                  "confidence interval. MFU is PaLM's convention (the study's); MFU megatron and HFU (counting "
                  "recomputation) are the same run under other FLOP conventions; MFU vs measured matmul divides "
                  "by a matmul peak each run measured on its device (noisy on shared machines).")
    table = []
    for name, rs in sweeps.items():
        st = Counter(r.status for r in rs)
        models = sorted({f"{r.model} seq {r.seq_len} batch {r.global_batch_size} {r.precision}" for r in rs})
        hw = sorted({f"{r.gpus} x {r.device}" for r in rs if r.device}) or ["?"]
        table.append([name, "; ".join(models), "; ".join(hw), str(len(rs))] +
                     [str(st.get(k, 0)) for k in STATUSES])
    s.tables.append(Table(["sweep", "workload", "devices", "runs", *STATUSES], table))
    hosts = sorted({h for r in rows for h in r.hosts})
    versions = sorted({v for r in rows for v in r.versions})
    if hosts or versions:
        s.text.append(f"Hosts: {', '.join(hosts[:12]) or '-'}{' ...' if len(hosts) > 12 else ''}. "
                      f"Software: {', '.join(versions) or '-'}.")
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


def axis_section(rows: list[Row], metric: Metric, sid: str, title: str, key, axis_name: str, intro: str,
                 plot: str = "bars", subset=None, rest=None) -> Section:
    """Best layout per value of one axis, per sweep: the study's way of showing an ablation. With
    `rest` (what else names a layout), also which component of the step moved (ablation_why)."""
    s = Section(sid, title, [intro])
    series: dict[str, list[tuple]] = {}
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
        for v in sorted(values, key=_sort_key):
            b = best.get(v)
            counts = ", ".join(f"{k} {n}" for k, n in sorted(status[v].items()))
            table.append([str(v), metric.fmt(metric.of(b)) if b else "-", fmt_s(b.step_median) if b else "-",
                          b.label if b else "(no run ok)", counts])
        s.tables.append(Table([axis_name, "best " + metric.short, "step",
                               "best layout", "runs"], table, name))
        moved = ablation_why(rs, metric, key, axis_name, rest) if rest else []
        if moved:
            s.text.append(f"{name}, what moved: " + " ".join(moved))
        if best:
            series[name] = [(v, metric.of(b), *(metric_ci(b, metric) or (None, None))) for v, b in best.items()]
            if plot == "bars" and shown < MAX_SWEEP_FIGS:
                labels = sorted(best, key=_sort_key)
                s.images.append((f"{sid}-{shown}", plots.bars([str(v) for v in labels],
                                                              [metric.of(best[v]) for v in labels],
                                                              f"{name}: best per {axis_name}",
                                                              metric.short, metric.percent,
                                                              [metric_ci(best[v], metric) for v in labels]),
                                 f"best {metric.short} per {axis_name} in {name}"))
                shown += 1
    if plot == "lines" and series:
        s.images.append((sid, plots.lines(dict(list(series.items())[:MAX_SWEEP_FIGS]), axis_name,
                                          metric.short, f"best layout per {axis_name}",
                                          metric.percent), f"best {metric.short} against {axis_name}"))
    if not s.tables:
        s.text.append(f"No sweep varied {axis_name} among comparable runs, so there is nothing to compare.")
    return s


def _tp_pp(r: Row) -> int:
    """The GPUs a run's tensor and pipeline degrees span (TP against PP compares runs at equal)."""
    return ParallelDims(tp=r.tp, pp=r.pp).product("tp", "pp")


def tp_pp(rows: list[Row], metric: Metric) -> Section:
    s = Section("tp-pp", "Tensor x pipeline parallelism",
                ["Best result per (tp, pp) cell over all other settings; a cell where nothing ran ok "
                 "shows the most frequent failure."])
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
        table = [[f"pp {pp}"] + [(metric.fmt(cells[(tp, pp)]) if isinstance(cells.get((tp, pp)), float)
                                  else str(cells.get((tp, pp), "")))
                                 for tp in tps] for pp in pps]
        s.tables.append(Table([""] + [f"tp {t}" for t in tps], table, name))
        for g in sorted({_tp_pp(r) for r in rs if _tp_pp(r) > 1}):
            moved = ablation_why([r for r in rs if _tp_pp(r) == g], metric, lambda r: f"tp{r.tp} pp{r.pp}", "",
                                 lambda r: (r.variant, r.context, r.dp, r.mb, r.ckpt, r.kernel))
            if moved:
                s.text.append(f"{name}, TP against PP at {g} model-parallel GPUs, what moved: " + " ".join(moved))
        if shown < MAX_SWEEP_FIGS:
            s.images.append((f"tp-pp-{shown}", plots.heatmap(cells, f"{name}: best per tp x pp", metric.percent),
                             f"heatmap of best {metric.short} per tp and pp in {name}"))
            shown += 1
    if not s.tables:
        s.text.append("No sweep varied tp or pp.")
    return s


def breakdown(rows: list[Row], metric: Metric) -> Section:
    s = Section("breakdown", "Where the time goes",
                ["Per profiled step (after the measured ones; the mean over ranks), for the best layouts of each "
                 "sweep: compute, exposed communication per axis, pipeline bubble, optimizer and other, in ms and % "
                 "of the step, with the collectives per step; source 'profiler' (the trace, every engine) or "
                 "'instrumented' (the engine's own counters). Then why the fastest of them beats the others."])
    shown = 0
    for name, rs in by_sweep(rows).items():
        picked = [r for r in ranked(rs, metric) if r.step_breakdown][:8]
        if not picked or shown >= MAX_SWEEP_FIGS:
            continue
        labels = [r.label for r in picked]
        keys = components([r.step_breakdown for r in picked])
        s.images.append((f"breakdown-{shown}", plots.stacked(labels, [r.step_breakdown.parts for r in picked],
                                                             f"{name}: ms per profiled step", scale=1.0,
                                                             names={k: component_title(k) for k in keys}),
                         f"stacked bars from zero of the time breakdown per layout in {name}"))
        shown += 1
        s.tables.append(Table(["layout", "source"] + [component_title(k) for k in keys] + ["step", "collectives"],
                              [[r.label, r.step_breakdown.source] + [ms_share(r.step_breakdown, k) for k in keys]
                               + [f"{r.step_breakdown.step_ms:.1f} ms", _collectives_text(r.collectives)]
                               for r in picked], name))
        engines, layouts = comparisons(why_cases(picked), limit=MAX_WHY)
        s.text += [f"{name}, why (the same layout under other engines): "
                   + (" ".join(engines) or "no layout among these ran under two engines."),
                   f"{name}, why (the same engine at other layouts): "
                   + (" ".join(layouts) or "no engine among these ran two layouts.")]
    if not shown:
        s.text.append("No run recorded a time breakdown.")
    return s


MAX_WHY = 6


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
    return "; ".join(f"{c.get('axis')} {c.get('kind')} x{c.get('count')} ({(c.get('bytes') or 0) / 2**20:,.1f} MiB)"
                     for c in coll) or "none"


def why_cases(rows: list[Row], label=None) -> list[Case]:
    return [Case(label(r) if label else r.label, r.variant, r.layout_key, r.step_median, r.step_breakdown)
            for r in rows if r.status == "ok" and r.step_breakdown]


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
    for v in sorted((v for v in best if v != winner), key=_sort_key):
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
    s.text.append(f"{'The chosen' if run_id and r.run_id.startswith(run_id) else 'The best pipelined'} run: "
                  f"{r.label} ({r.sweep}, run {r.run_id[:10]}). Forward (F) and "
                  "backward (B) passes per micro-batch and stage; the white space is the pipeline bubble "
                  "(on that stage: waiting for its neighbours).")
    stages = sorted({e.get("stage", 0) for e in r.timeline})
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
    s.text.append("Status counts: " + ", ".join(f"{k} {n}" for k, n in c.most_common()) +
                  ". oom: the run raised CUDA out-of-memory; failed: another error (excerpt below); "
                  "timeout: killed after the per-run limit.")
    shown = sorted(bad, key=lambda r: (r.sweep, r.status, r.label))[:MAX_FAILED_ROWS]
    s.tables.append(Table(["sweep", "status", "layout", "reason", "run"],
                          [[r.sweep, r.status, r.label, r.reason or "-", r.run_id[:10]] for r in shown],
                          f"{len(shown)} of {len(bad)} shown" if len(bad) > len(shown) else ""))
    return s


def quoted(rows: list[Row], metric: Metric, base: dict) -> Section:
    s = Section("baselines", "Measured against quoted",
                ["QUOTED figures come from publications (source in each row); MEASURED figures are runs in "
                 "this store. They are comparable only where model, sequence length, batch and hardware "
                 "agree, which the table states."])
    study = base.get("study") or []
    if study:
        table = []
        for b in study:
            same = [r for r in ranked(rows, metric) if r.model == b["harness_model"]
                    and str(r.seq_len) == b["seq_len"]]
            # prefer the same GPU count and batch; a stable sort keeps the ranking within each group
            same.sort(key=lambda r: (str(r.gpus) != b["gpus"], str(r.global_batch_size) != b["global_batch_size"]))
            m = same[0] if same else None
            meas = "no measured run of this model and sequence length"
            if m:
                meas = f"MEASURED {metric.fmt(metric.of(m))} on {m.gpus} x {m.device or '?'}: {m.label}"
                diffs = [d for d, bad in (("GPU count", str(m.gpus) != b["gpus"]),
                                          ("global batch", str(m.global_batch_size) != b["global_batch_size"]),
                                          ("GPU type", "A100" not in m.device or "80" not in m.device),
                                          ("metric", metric.key != "mfu")) if bad]
                if diffs:
                    meas += f" (not comparable: different {', '.join(diffs)})"
            table.append([b["model"], f"{b['gpus']} x A100 80GB", f"seq {b['seq_len']}, batch {b['global_batch_size']}",
                          f"QUOTED {100 * float(b['mfu']):.1f}%",
                          f"tp{b['tp']} pp{b['pp']} mb{b['micro_batch_size']} ckpt {b['activation_checkpointing']} "
                          f"{b['kernel']}" + (" sp" if b.get("sequence_parallel") == "True" else ""), meas,
                          f"{b['source_file']} ({b['runs_ok']} ok / {b['runs']} runs)"])
        s.tables.append(Table(["model", "hardware", "workload", "study's best MFU", "study's best layout",
                               "measured here", "source data"], table,
                              "Source: " + study[0]["source"] + "; data licence " + study[0]["license"]))
    fw = base.get("frameworks") or []
    if fw:
        s.tables.append(Table(["framework", "model", "devices", "hardware", "seq", "QUOTED MFU", "convention",
                               "source"],
                              [[f["framework"], f["model"], f["devices"], f["hardware"], f["seq_len"],
                                f"{100 * float(f['mfu']):.1f}%", f["convention"], f"{f['source']}, {f['location']}"]
                               for f in fw], "Other training stacks, as published"))
    best = ranked(rows, metric)
    if best:
        s.tables.append(Table(["sweep", "MEASURED best", "layout", "devices"],
                              [[n, metric.fmt(metric.of(b[0])), b[0].label, f"{b[0].gpus} x {b[0].device or '?'}"]
                               for n, b in ((n, ranked(rs, metric)) for n, rs in by_sweep(rows).items()) if b],
                              "Measured in this store"))
    if not study and not fw:
        s.text.append("No baselines directory was found (pass --baselines DIR).")
    return s
