"""The comparison report: one list of sections (sections()), written as Markdown and as a
single-file HTML page by render.py, from the comparison summary.

The summary (also written as JSON next to the report) holds everything shown: the workload,
every run's layout, status and metrics, the parity check with its tolerance, and the
fingerprint check. Nothing here measures; it only lays out what the records say.
"""

from __future__ import annotations

import json
import os

from harness.report import plots, render
from harness.report.compare_layouts import differing_fields, differs_texts, layout_matrix
from harness.report.compare_machine import OVERSUBSCRIBED, machine_text, oversubscribed
from harness.report.compare_reproduce import engines_section, keep_traces, trace_links
from harness.report.compare_steps import (
    BREAKDOWN_AXIS,
    BREAKDOWN_TEXT,
    COLLECTIVES_TEXT,
    TRACES_TEXT,
    breakdown_rows,
    census_rows,
    census_text,
    collective_rows,
    compute_flags,
    flop_text,
    run_breakdown,
    sorted_components,
    why_section,
)
from harness.report.data import component_title, coverage_of, interval_name, measured_columns
from harness.report.drift import baseline_sections
from harness.report.policy import check_texts, held_text, parity_cell, policy_sentence, steps_text, verdict_text
from harness.report.policy import sci as _sci
from harness.report.precision_groups import group_parity_texts, policy_of
from harness.report.ranking import rate_ci
from harness.report.render import save_figures
from harness.report.routing import routing_figures, routing_sections
from harness.report.sections import Code, Column, Figure, Items, Section, Table, table
from harness.spec import layout_label, process_counts
from harness.store import PASS


def policy_exceptions(summary: dict) -> list[tuple[str, str]]:
    """Runs whose engine says it ran another precision policy than the workload's, or whose census
    shows it held another (none should: every engine is configured to it, or the spec refuses the run)."""
    out = [  # against the policy of the run's precision group (one group: the workload's)
        (r["label"], f"ran another precision policy: {r['precision_policy']}")
        for r in summary["runs"]
        if r.get("precision_policy")
        and policy_of(r, summary) not in (None, r["precision_policy"])
        and not r.get("baseline")
    ]
    held = (summary.get("policy") or {}).get("differ") or {}
    return out + [
        (label, f"held another precision policy (memory census): {held_text(items)}") for label, items in held.items()
    ]


def loss_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """The first parity_steps losses of every run, one row per run ('-' past a run's last step):
    a column per run would run off the page once a comparison has more than a few runs."""
    steps, n = summary.get("loss_table") or {}, summary["parity"]["steps"]
    return (
        ["Run"] + [f"step {i}" for i in range(n)],
        [
            [label] + [f"{losses[i]:.7f}" if i < len(losses) else "-" for i in range(n)]
            for label, losses in steps.items()
        ],
    )


MATRIX_TEXT = (
    "Each cell: median step time [interval of the median] (its coverage) and the loss-parity verdict; a "
    "dash gives the reason the "
    "engine cannot run that layout (checked before launch: each engine's facts, harness/frameworks/*/facts.py)."
)


def _note(item: dict) -> str:
    run, p = item["run"], item["parity"]
    if run["status"] != "ok":  # its cause is the loss-parity cell (parity_cell)
        return run.get("override_note", "")
    over = "oversubscribed: times not ranked" if item.get("oversubscribed") else ""
    return "; ".join(x for x in [p.get("note", ""), run.get("override_note", ""), run.get("error_line", ""), over] if x)


def result_columns() -> list[Column]:
    """The table of runs: what names a run, every reported measurement (harness.store.fields), its parity."""
    return [
        Column("Run", lambda i: i["run"]["label"]),
        Column("Engine", lambda i: i["run"]["engine"]),
        Column("Layout", lambda i: layout_label(i["run"]["layout"])),
        Column("Fields that differ", lambda i: i["differs"]),
        Column("Status", lambda i: i["run"]["status"]),
        *measured_columns(lambda i: i["run"].get("row") or {}),
        Column("Loss parity", lambda i: parity_cell(i["run"], i["parity"])),
        Column("Max rel. diff", lambda i: _sci(i["parity"].get("max_rel_diff"))),
        Column("Note", _note),
    ]


def results_table(summary: dict) -> Table:
    """One row per run (result_columns); a measurement no run has (MFU against a datasheet peak
    on a CPU) is left out rather than shown as a column of dashes."""
    parity = {p["label"]: p for p in summary["parity"]["runs"]}
    items = [
        {"run": r, "differs": d, "parity": parity.get(r["label"], {}), "oversubscribed": oversubscribed(r, summary)}
        for r, d in zip(summary["runs"], differs_texts(summary), strict=True)
    ]
    measured = {c.header for c in measured_columns(lambda i: i)}
    columns = [c for c in result_columns() if c.header not in measured or any(c.cell(i) != "-" for i in items)]
    return table(columns, items)


STEP_TEXT = (
    "Step time: median over the measured steps (warm-up excluded), each step the slowest rank's, "
    "with the interval of the median: the order statistics whose exact coverage reaches 95% (at 8 steps "
    "the range, 99.2%; below 6 steps no pair reaches 95% and the range is given at its coverage, n = 5: "
    "93.8%; the JSON's step_time_s.ci_coverage), every table and figure giving that coverage beside it. "
    "MFU uses the PaLM convention (6N + 12·L·h·s FLOPs "
    "per token) counted by the harness from the model shape, not by a framework's profiler (DeepSpeed's "
    "flops profiler double-counts under ZeRO-3), per device; the MFU columns against a datasheet peak "
    "are left out where the device has none (a CPU). Peak memory: CUDA allocator peak, or peak RSS per "
    "process on CPU."
)
PEAK_TEXT = (
    "MFU vs measured matmul divides by one peak for the whole comparison: {tflops:.3f} TFLOP/s, the best "
    "{dtype} square-GEMM rate measured once before the runs on {device} with the threads of one process "
    "({threads}), so every run is divided by the same number."
)
DIFFERS_TEXT = (
    "The runs differ in {fields}; the column 'Fields that differ' gives each run's values (a field "
    "equal in every run is left out, and so is one that does not apply to a run's engine)."
)
FIGURES_TEXT = (
    "First, tokens/s per run at its median step time, drawn from zero, with the interval of the "
    "median carried through (whiskers, their coverage in the axis label); then the distribution of every "
    "measured step (warm-up excluded; box: quartiles, red: median, black: its interval, at the coverage "
    "the legend gives, dots: the "
    "steps; this axis does not start at zero, to show the spread)."
)
LOSS_FIGURE_TEXT = "The loss of every step of every run (warm-up shaded); runs in parity lie on top of each other."


def figures(summary: dict) -> list[tuple[str, bytes, str]]:
    """The comparison's figures as (name, svg, alt): throughput with CI whiskers, the step-time
    distribution and the loss curves; a figure without data (no run finished, a summary written
    before the per-step series were kept) is left out."""
    ok = [r for r in summary["runs"] if r["status"] == "ok"]
    out = []

    def name(r: dict) -> str:  # an oversubscribed run's bar says so (compare_machine)
        return r["label"] + (f" ({OVERSUBSCRIBED})" if oversubscribed(r, summary) else "")

    rated = [
        (r, (r.get("metrics") or {}).get("tokens_per_s"), (r.get("metrics") or {}).get("step_time_s") or {}) for r in ok
    ]
    rated = [(r, tps, st) for r, tps, st in rated if isinstance(tps, (int, float))]

    def whisker(sts) -> str:  # 'interval of the median (99.2%)': the intervals' real coverage
        return interval_name(coverage_of(st.get("ci_coverage"), st.get("n")) for st in sts)

    if rated:
        out.append(
            (
                "throughput",
                plots.bars(
                    [name(r) for r, _, _ in rated],
                    [tps for _, tps, _ in rated],
                    "Throughput per run (higher is better)",
                    "tokens/s (all ranks, at the median step)",
                    False,
                    [rate_ci(tps, st.get("median"), (st.get("ci95_low"), st.get("ci95_high"))) for _, tps, st in rated],
                    whisker(st for _, _, st in rated),
                ),
                f"tokens/s per run from zero, with whiskers: {whisker(st for _, _, st in rated)}",
            )
        )
    times = {name(r): (r.get("metrics") or {}).get("step_times_s") for r in ok}
    times = {k: v for k, v in times.items() if v}
    if times:
        cis = {
            name(r): (
                (r["metrics"].get("step_time_s") or {}).get("ci95_low"),
                (r["metrics"].get("step_time_s") or {}).get("ci95_high"),
            )
            for r in ok
        }
        out.append(
            (
                "step-times",
                plots.distribution(
                    times,
                    "Step time per measured step (warm-up excluded)",
                    "ms per step (each step the slowest rank's)",
                    cis,
                    whisker=whisker((r["metrics"].get("step_time_s") or {}) for r in ok if name(r) in times),
                ),
                "distribution of the measured step times per run",
            )
        )
    split = [(r["label"], run_breakdown(r)) for r in summary["runs"]]
    split = [(lab, b) for lab, b in split if b is not None]
    if split:
        keys = sorted_components([b for _, b in split])
        out.append(
            (
                "breakdown",
                plots.stacked(
                    [lab for lab, _ in split],
                    [b.parts for _, b in split],
                    "Where the step goes",
                    scale=1.0,
                    names={k: component_title(k) for k in keys},
                    xlabel=BREAKDOWN_AXIS,
                ),
                "stacked bars from zero: ms per step by component, per run (the source column says which steps)",
            )
        )
    curves = summary.get("loss_curves") or summary.get("loss_table") or {}
    if curves:
        out.append(
            (
                "loss-curves",
                plots.loss_curves(
                    curves, int((summary.get("workload") or {}).get("warmup_steps") or 0), "Loss per step"
                ),
                "loss per step of every run",
            )
        )
    return out + routing_figures(summary)


def image_dir(summary: dict) -> str:
    """The figures' folder, relative to the report (the Markdown links them from there)."""
    return f"compare-{summary['name']}-img"


def _workload_text(w: dict) -> str:
    o = w.get("optimizer") or {}
    return (
        f"model `{w.get('model')}`, seq_len {w.get('seq_len')}, global batch {w.get('global_batch_size')} "
        f"sequences, {w.get('warmup_steps')} warm-up + {w.get('steps')} measured steps, {w.get('precision')}, "
        f"AdamW lr {o.get('lr')} betas {o.get('betas')} eps {o.get('eps')} wd {o.get('weight_decay')}, "
        f"clip {w.get('grad_clip')}, seed {w.get('seed')}, data {(w.get('data') or {}).get('kind')}, "
        f"device {w.get('device')}"
    )


def _figures(figs, names: tuple[str, ...]) -> list[Figure]:
    return [Figure(name, image, alt) for name, image, alt in figs if name in names]


def _lead(summary: dict) -> Section:
    verdict, why = verdict_text(summary).split(" - ", 1)
    return Section(
        "lead",
        "",
        body=[
            f"Generated {summary['created_at']} by `harness compare`; results store `{summary['store']}`.",
            f"**Verdict: {verdict}** - {why}.",
        ],
    )


def _workload(summary: dict) -> Section:
    return Section(
        "workload",
        "Workload (identical for every run)"  # but where a run overrides it (the exceptions' section lists it)
        if not any(r.get("workload_override") for r in summary["runs"])
        else "Workload (every run's, but the overrides listed below)",
        body=[
            _workload_text(summary["workload"]),
            policy_sentence(summary),
            f"{process_counts([r['nproc'] for r in summary['runs']])}. Initial weights are generated from the seed, "
            "bit-identical for every engine; every data-parallel rank takes its contiguous slice of the same global "
            "batch.",
        ],
    )


def _results(summary: dict) -> Section:
    differing = differing_fields(summary)
    body = [DIFFERS_TEXT.format(fields=", ".join(differing))] if differing else []
    body.append(results_table(summary))
    body += [STEP_TEXT, *flop_text(summary)]
    if summary.get("matmul_peak"):
        body.append(PEAK_TEXT.format(**summary["matmul_peak"]))
    return Section("results", "Results", body=body)


def _parity(summary: dict, figs: list) -> Section:
    par = summary["parity"]
    body = (
        group_parity_texts(summary)
        if par.get("groups")
        else [
            f"The per-step losses of {steps_text(par)} (warm-up included) of every run, each step's global gradient "
            "norm before clipping and the final weights where the engine gives them, are compared with the "
            f"{par['anchor_kind']} (`{par['anchor']}`). Tolerance: max relative difference "
            f"**{par['tolerance']:g}** ({summary['tolerance_source']}). "
            + (
                "Fewer than two runs finished: no difference between runs to give."
                if par["max_pairwise_rel_diff"] is None
                else f"Largest difference between any two finished runs: {_sci(par['max_pairwise_rel_diff'])} "
                f"({'within' if par['cross_engine_ok'] else 'OUTSIDE'} tolerance)."
            )
        ]
        + check_texts(par)
    )  # gradient norms and final weights, at the same tolerance (harness.compare.parity)
    if any(name == "loss-curves" for name, _, _ in figs):
        body += [LOSS_FIGURE_TEXT, *_figures(figs, ("loss-curves",))]
    if summary.get("loss_table"):
        body.append(Table(*loss_rows(summary)))
    fails = [p for p in par["runs"] if p["verdict"] != PASS]
    if fails:
        body += [
            "Parity failures:",
            Items([f"**{p['label']}**: {p['verdict']}{' - ' + p['note'] if p['note'] else ''}" for p in fails]),
        ]
    return Section("parity", "Loss parity", body=body)


def _exceptions(summary: dict) -> list[Section]:
    notes = [f"{lab}: {note}" for lab, note in policy_exceptions(summary)]
    notes += [
        f"{r['label']}: workload overridden in the compare spec: `{json.dumps(r['workload_override'])}`"
        for r in summary["runs"]
        if r.get("workload_override")
    ]
    return (
        [Section("exceptions", "Where a run does not express the workload exactly", body=[Items(notes)])]
        if notes
        else []
    )


def _not_run(summary: dict) -> list[Section]:
    return (
        [Section("not-run", "Not run", body=[Items([f"{lab}: {why}" for lab, why in summary["skipped"]])])]
        if summary["skipped"]
        else []
    )


def _failed(summary: dict) -> list[Section]:
    if not summary["failed_runs"]:
        return []
    body = []
    for r in summary["runs"]:
        if r["status"] != "ok":
            body += [
                Items([f"**{r['label']}**: {r['status']} (run {r['run_id']}, log `{r.get('log')}`)"]),
                Code((r.get("error") or "").strip()[-1500:]),
            ]
    return [Section("failed", "Failed runs", body=body)]


def _fingerprints(summary: dict) -> Section:
    fp = summary["fingerprints"]
    if fp["same"]:
        body = ["Every run saw the same hosts, devices and library versions:"]
    else:
        labels = list(fp["differences"][0]["values"])
        body = [
            f"**Runs differ in {', '.join(fp['flagged_groups'])}** - the comparison is not on identical "
            "hardware/software:",
            Table(
                ["Key", "Group", *labels],
                [[d["key"], d["group"], *map(str, d["values"].values())] for d in fp["differences"]],
            ),
            "Common to all runs:",
        ]
    body.append(Items([f"{k}: {v}" for k, v in fp["common"].items()]))
    if fp["without_fingerprint"]:
        body.append(f"Runs without a fingerprint (no record from the runner): {', '.join(fp['without_fingerprint'])}")
    body.append("Run ids: " + ", ".join(f"{r['label']} `{r['run_id']}`" for r in summary["runs"]))
    return Section("fingerprints", "Fingerprints", body=body)


def sections(summary: dict, figs: list | None = None) -> list[Section]:
    """The comparison report, once: render.py writes it as Markdown and as HTML (trace links: the copies
    write_report keeps beside the report, compare_reproduce.keep_traces)."""
    figs = figures(summary) if figs is None else figs
    out = [_lead(summary), _workload(summary), _results(summary)]
    if any(name in ("throughput", "step-times") for name, _, _ in figs):
        out.append(
            Section(
                "figures",
                "Throughput and step times",
                body=[FIGURES_TEXT, *_figures(figs, ("throughput", "step-times"))],
            )
        )
    out += [
        Section("matrix", "Layouts by engine", body=[MATRIX_TEXT, Table(*layout_matrix(summary))]),
        Section(
            "breakdown",
            "Where the step goes",
            body=[BREAKDOWN_TEXT, *_figures(figs, ("breakdown",)), Table(*breakdown_rows(summary))]
            + compute_flags(summary),
        ),
        Section("collectives", "Collectives per step", body=[COLLECTIVES_TEXT, Table(*collective_rows(summary))]),
        *routing_sections(summary, figs),
        Section(
            "traces",
            "Traces",
            body=[TRACES_TEXT, Items([f"**{r['label']}**: {trace_links(r)}" for r in summary["runs"]])],
        ),
        why_section(summary),
        Section("census", "Memory census", body=[*census_text(summary), Table(*census_rows(summary))]),
        Section("machine", "Cores, processes and threads", body=machine_text(summary)),
        _parity(summary, figs),
        *baseline_sections(summary),
        *_exceptions(summary),
        engines_section(summary),
        *_not_run(summary),
        *_failed(summary),
        _fingerprints(summary),
    ]
    return out


def write_report(summary: dict, out_dir: str) -> dict[str, str]:
    """compare-<name>.md (figures as SVG files in compare-<name>-img/), .html (figures inline) and
    .json (the summary), written whole or not at all (a full disk leaves the earlier report as it was)."""
    from harness.files.atomic import Together

    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"compare-{summary['name']}")
    paths = {"markdown": base + ".md", "html": base + ".html", "json": base + ".json"}
    figs = figures(summary)
    title = f"Framework comparison: {summary['name']}"
    with Together("--out") as files:
        keep_traces(summary, out_dir, files)  # before the sections: they link the copies
        secs = sections(summary, figs)
        if figs:  # the Markdown links them; the HTML holds them inline
            paths["images"] = os.path.join(out_dir, image_dir(summary))
            save_figures(paths["images"], secs, files)
        files.write(paths["markdown"], render.markdown(title, secs, image_dir(summary), contents=False))
        files.write(paths["html"], render.html_page(title, secs))
        files.write(paths["json"], json.dumps(summary, indent=1, sort_keys=True, default=str))
    if figs:
        render.remove_stale(paths["images"], secs)
    return paths
