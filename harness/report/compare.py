"""The comparison report: Markdown and a single-file HTML page, from the comparison summary.

The summary (also written as JSON next to the report) holds everything shown: the workload,
every run's layout, status and metrics, the parity check with its tolerance, and the
fingerprint check. Nothing here measures; it only lays out what the records say.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os

from harness.report import plots
from harness.report.analysis import rate_ci
from harness.report.render import img_tag
from harness.spec import Layout, capability_error, engine_variant, layout_label, parallel_label
from harness.store import PASS


def _ms(x) -> str:
    return f"{x * 1e3:.1f}" if isinstance(x, (int, float)) else "n/a"


def _num(x, fmt="{:,.0f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "n/a"


def _pct(x) -> str:
    return f"{100 * x:.2f}%" if isinstance(x, (int, float)) else "n/a"


def _mib(x) -> str:
    return f"{x / 2**20:,.0f} MiB" if isinstance(x, (int, float)) and x else "n/a"


def _sci(x) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.1e}"


# What tells a comparison's layouts apart (the matrix's rows); the engine variant is the column.
ROW_FIELDS = ("tp", "pp", "dp", "sequence_parallel", "micro_batch_size", "activation_checkpointing")
BREAKDOWN = (("compute", "compute"), ("tp_comm", "exposed TP comm"), ("bubble", "pipeline bubble"),
             ("dp_comm", "exposed DP comm"), ("optimizer", "optimizer"))
NOT_MEASURED = "not measured"


# What makes a matrix column (engine_variant); every other field that differs between runs is a row.
VARIANT_FIELDS = ("engine", "zero_stage", "reshard_after_forward", "model_impl")


def _full_layout(layout: dict) -> dict:
    return {**dataclasses.asdict(Layout()), **(layout or {})}


def _run_fields(run: dict, workload: dict) -> dict:
    """Every layout field of a run, and every workload field a run overrides (`workload.<key>`,
    with the compared workload's value for the runs that do not)."""
    return {**_full_layout(run.get("layout")),
            **{f"workload.{k}": v for k, v in (workload or {}).items()},
            **{f"workload.{k}": v for k, v in (run.get("workload_override") or {}).items()}}


def differing_fields(summary: dict) -> list[str]:
    """The fields whose value is not the same in every run (the engine has its own column),
    in the Layout's field order: computed from the layouts, not from a list of usual suspects."""
    fields = [_run_fields(r, summary.get("workload")) for r in summary["runs"]]
    keys = list(dict.fromkeys(k for f in fields for k in f))
    return [k for k in keys if k != "engine" and
            len({json.dumps(f.get(k), sort_keys=True, default=str) for f in fields}) > 1]


def _field_value(key: str, value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if key == "ds_config":
        return os.path.basename(value) if value else "none"
    return json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else str(value)


def differs_texts(summary: dict) -> list[str]:
    """Per run (in order), `field=value` for each field that differs between the compared runs
    ('-' for none), less the fields that do not apply to that run. Which apply, the layout's label
    says (spec.layout_label, the one place that knows it): a field the label shows for some run but
    whose other values would not change this run's label is not this run's (reshard_after_forward
    under the own engine, zero_stage under FSDP2, the schedule without pipeline stages); a field no
    label shows (ds_config, a workload override) always applies."""
    keys = differing_fields(summary)
    everyone = [_run_fields(r, summary.get("workload")) for r in summary["runs"]]
    values = {k: [v for v in {json.dumps(f.get(k), sort_keys=True, default=str): f.get(k) for f in everyone}.values()]
              for k in keys}

    def changes_label(fields: dict, key: str) -> bool:
        if key.startswith("workload."):
            return False
        lay = {k: v for k, v in fields.items() if not k.startswith("workload.")}
        return any(layout_label({**lay, key: v}) != layout_label(lay) for v in values[key] if v != lay[key])

    labelled = {k: [changes_label(f, k) for f in everyone] for k in keys}
    return [" ".join(f"{k}={_field_value(k, f.get(k))}" for k in keys if labelled[k][i] or not any(labelled[k]))
            or "-" for i, f in enumerate(everyone)]


def _row_text(lay: dict, extra_fields: tuple = ()) -> str:
    extra = [f"mbs {lay['micro_batch_size']}"]
    if lay["activation_checkpointing"] != "none":
        extra.append(f"ckpt {lay['activation_checkpointing']}")
    extra += [f"{k}={_field_value(k, lay[k])}" for k in extra_fields]
    return " ".join([parallel_label(lay) or "one process"] + extra)


def layout_matrix(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Layouts by engine: per cell the run's median step time [95% CI] and parity verdict, or a
    dash with the reason the engine cannot run that layout (harness.spec.CAPABILITIES)."""
    runs = [r for r in summary["runs"] if not r.get("is_reference")]
    parity = {p["label"]: p["verdict"] for p in summary["parity"]["runs"]}
    entries = [(_full_layout(r["layout"]), r) for r in runs] + \
              [(_full_layout(n["layout"]), n) for n in summary.get("not_runnable") or []]
    # a field outside ROW_FIELDS that differs (virtual stages, schedule, kernels...) makes rows too
    extra = tuple(k for k in _full_layout({}) if k not in ROW_FIELDS + VARIANT_FIELDS
                  and len({json.dumps(lay[k], default=str) for lay, _ in entries}) > 1)
    row_fields = ROW_FIELDS + extra
    rows, cols, cells = {}, {}, {}
    for lay, entry in entries:
        row, col = tuple(lay[k] for k in row_fields), engine_variant(lay)
        rows.setdefault(row, lay)
        cols.setdefault(col, lay)
        if "why" in entry:
            cells[row, col] = f"– {entry['why']}"
        else:
            st = (entry.get("metrics") or {}).get("step_time_s") or {}
            cells[row, col] = (f"{_ms(st.get('median'))} ms [{_ms(st.get('ci95_low'))}, {_ms(st.get('ci95_high'))}] "
                               f"{parity.get(entry['label'], '-')}" if st else f"{entry['status']}")
    table = []
    for row, row_lay in rows.items():
        line = [_row_text(row_lay, extra)]
        for col, col_lay in cols.items():
            if (row, col) not in cells:
                merged = {**col_lay, **{k: row_lay[k] for k in row_fields}}
                error = capability_error(Layout(**merged))
                cells[row, col] = f"– {error}" if error else "not run"
            line.append(cells[row, col])
        table.append(line)
    return ["layout"] + list(cols), table


def policy_exceptions(summary: dict) -> list[tuple[str, str]]:
    """Runs whose engine says it ran another precision policy than the workload's (none should:
    every engine is configured to it, or the spec refuses the run)."""
    policy = summary.get("precision_policy")
    return [(r["label"], f"ran another precision policy: {r['precision_policy']}") for r in summary["runs"]
            if r.get("precision_policy") and policy and r["precision_policy"] != policy]


def _comm_text(comm: dict | None) -> str:
    if not comm:
        return NOT_MEASURED if comm is None else "none"
    return "; ".join(f"{axis}: " + ", ".join(f"{op} x{v['count']} ({v['bytes'] / 2**20:,.1f} MiB)"
                                             for op, v in ops.items())
                     for axis, ops in comm.items() if ops) or "none"


def breakdown_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Where each run's step goes, per category, and its collectives per step; a framework that
    does not expose a figure gets 'not measured', never an estimate."""
    header = ["run"] + [title for _, title in BREAKDOWN] + ["collectives per step (rank 0)"]
    out = []
    for r in summary["runs"]:
        m = r.get("metrics") or {}
        b = m.get("breakdown_s")
        out.append([r["label"]] + [_ms(b.get(k)) + " ms" if b and b.get(k) is not None else NOT_MEASURED
                                   for k, _ in BREAKDOWN] + [_comm_text(m.get("comm"))])
    return header, out


CENSUS_TEXT = ("Bytes rank 0 held at its first optimizer step, by category and dtype, counted from the tensors "
               "the engine really holds (each storage once), and in multiples of the model's parameter count P; "
               "activations: what autograd saved for backward, per micro-batch. What a framework holds beyond the "
               "policy is shown as it is.")


def _census_cell(by_dtype: dict | None, params: int | None) -> str:
    if not by_dtype:
        return "none" if by_dtype is not None else NOT_MEASURED
    return ", ".join(f"{dtype} {n / 2**20:,.2f} MiB" + (f" ({n / params:.2f}P)" if params else "")
                     for dtype, n in sorted(by_dtype.items()))


def census_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Each run's memory census (rank 0) and saved activations; 'not measured' where absent."""
    categories = ("parameters", "gradients", "master_parameters", "optimizer_states")
    header = ["run"] + [c.replace("_", " ") for c in categories] + ["activations saved / micro-batch"]
    rows = []
    for r in summary["runs"]:
        m = r.get("metrics") or {}
        census, params, act = m.get("memory_census"), m.get("parameter_count"), m.get("activations_saved_bytes")
        rows.append([r["label"]] + [_census_cell(census.get(c, {}) if census is not None else None, params)
                                    for c in categories]
                    + [f"{act / 2**20:,.2f} MiB" if act is not None else NOT_MEASURED])
    return header, rows


def loss_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """The first parity_steps losses of every run, side by side ('-' past a run's last step)."""
    steps, n = summary.get("loss_table") or {}, summary["parity"]["steps"]
    return (["Step"] + list(steps),
            [[str(i)] + [f"{losses[i]:.7f}" if i < len(losses) else "-" for losses in steps.values()]
             for i in range(n)])


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    esc = lambda x: str(x).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(map(esc, r)) + " |" for r in rows]


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    return ("<table><tr>" + "".join(f"<th>{_h(x)}</th>" for x in header) + "</tr>" +
            "".join("<tr>" + "".join(f"<td>{_h(x)}</td>" for x in r) + "</tr>" for r in rows) + "</table>")


MATRIX_TEXT = ("Each cell: median step time [95% CI] and the loss-parity verdict; a dash gives the reason the "
               "engine cannot run that layout (checked before launch, harness.spec.CAPABILITIES).")
BREAKDOWN_TEXT = ("Medians over the measured steps, as each engine reports them (the mean over ranks); "
                  "'not measured' where the framework does not expose the figure - never estimated.")


THREADS_TEXT = ("Threads per process: {n} (OMP_NUM_THREADS), the same for every run, the single-device "
                "reference included: cores divided by the comparison's process count, so that step times "
                "compare layouts rather than thread counts.")


def table_rows(summary: dict) -> list[dict]:
    parity = {p["label"]: p for p in summary["parity"]["runs"]}
    differs = differs_texts(summary)
    rows = []
    for r, differ in zip(summary["runs"], differs):
        m = r.get("metrics") or {}
        st = m.get("step_time_s") or {}
        mfu = (m.get("mfu") or {}).get("palm")
        mfu_meas = (m.get("mfu_vs_measured_matmul") or {}).get("palm")
        p = parity.get(r["label"], {})
        rows.append({
            "label": r["label"], "engine": r["engine"], "layout": layout_label(r["layout"]),
            "differs": differ,
            "launcher": r["launcher"], "status": r["status"],
            "step_ms": f"{_ms(st.get('median'))} [{_ms(st.get('ci95_low'))}, {_ms(st.get('ci95_high'))}]"
            if st else "n/a",
            "tokens_s": _num(m.get("tokens_per_s")),
            "mfu": _pct(mfu), "mfu_measured": _pct(mfu_meas),
            "memory": _mib(m.get("peak_memory_bytes")) + (f" ({m['memory_kind']})" if m.get("memory_kind") and
                                                         m.get("peak_memory_bytes") else ""),
            "parity": p.get("verdict", "-"), "rel_diff": _sci(p.get("max_rel_diff")),
            "note": "; ".join(x for x in [p.get("note", ""), r.get("override_note", ""), r.get("error_line", "")] if x),
        })
    return rows


COLUMNS = [("label", "Run"), ("engine", "Engine"), ("layout", "Layout"), ("differs", "Fields that differ"),
           ("status", "Status"),
           ("step_ms", "Step time median [95% CI] (ms)"), ("tokens_s", "Tokens/s"),
           ("mfu", "MFU (PaLM, datasheet peak)"), ("mfu_measured", "MFU (vs measured matmul peak)"),
           ("memory", "Peak memory"), ("parity", "Loss parity"), ("rel_diff", "Max rel. diff"), ("note", "Note")]


DIFFERS_TEXT = ("The runs differ in {fields}; the column 'Fields that differ' gives each run's values (a field "
                "equal in every run is left out, and so is one that does not apply to a run's engine).")
FIGURES_TEXT = ("First, tokens/s per run at its median step time, drawn from zero, with the 95% confidence "
                "interval of the median carried through (whiskers); then the distribution of every "
                "measured step (warm-up excluded; box: quartiles, red: median, black: its 95% CI, dots: the "
                "steps; this axis does not start at zero, to show the spread).")
LOSS_FIGURE_TEXT = "The loss of every step of every run (warm-up shaded); runs in parity lie on top of each other."


def figures(summary: dict) -> list[tuple[str, bytes, str]]:
    """The comparison's figures as (name, svg, alt): throughput with CI whiskers, the step-time
    distribution and the loss curves; a figure without data (no run finished, a summary written
    before the per-step series were kept) is left out."""
    ok = [r for r in summary["runs"] if r["status"] == "ok"]
    out = []
    rated = [(r, (r.get("metrics") or {}).get("tokens_per_s"), (r.get("metrics") or {}).get("step_time_s") or {})
             for r in ok]
    rated = [(r, tps, st) for r, tps, st in rated if isinstance(tps, (int, float))]
    if rated:
        out.append(("throughput", plots.bars(
            [r["label"] for r, _, _ in rated], [tps for _, tps, _ in rated], "Throughput per run (higher is better)",
            "tokens/s (all ranks, at the median step)", False,
            [rate_ci(tps, st.get("median"), (st.get("ci95_low"), st.get("ci95_high"))) for _, tps, st in rated]),
            "tokens/s per run from zero, with 95% CI whiskers"))
    times = {r["label"]: (r.get("metrics") or {}).get("step_times_s") for r in ok}
    times = {k: v for k, v in times.items() if v}
    if times:
        cis = {r["label"]: ((r["metrics"].get("step_time_s") or {}).get("ci95_low"),
                            (r["metrics"].get("step_time_s") or {}).get("ci95_high")) for r in ok}
        out.append(("step-times", plots.distribution(times, "Step time per measured step (warm-up excluded)",
                                                     "ms per step (each step the slowest rank's)", cis),
                    "distribution of the measured step times per run"))
    curves = summary.get("loss_curves") or summary.get("loss_table") or {}
    if curves:
        out.append(("loss-curves", plots.loss_curves(curves, int((summary.get("workload") or {}).get("warmup_steps")
                                                                 or 0), "Loss per step"),
                    "loss per step of every run"))
    return out


def image_dir(summary: dict) -> str:
    """The figures' folder, relative to the report (the Markdown links them from there)."""
    return f"compare-{summary['name']}-img"


def _md_figures(figs, names: tuple[str, ...], img_dir: str) -> list[str]:
    return [line for name, _, alt in figs if name in names
            for line in (f"![{alt}]({img_dir}/{name}.{plots.FORMAT})", "")]


def _html_figures(figs, names: tuple[str, ...]) -> str:
    return "".join(img_tag(name, image, alt) for name, image, alt in figs if name in names)


def _workload_text(w: dict) -> str:
    o = w.get("optimizer") or {}
    return (f"model `{w.get('model')}`, seq_len {w.get('seq_len')}, global batch {w.get('global_batch_size')} "
            f"sequences, {w.get('warmup_steps')} warm-up + {w.get('steps')} measured steps, {w.get('precision')}, "
            f"AdamW lr {o.get('lr')} betas {o.get('betas')} eps {o.get('eps')} wd {o.get('weight_decay')}, "
            f"clip {w.get('grad_clip')}, seed {w.get('seed')}, data {(w.get('data') or {}).get('kind')}, "
            f"device {w.get('device')}")


def markdown(summary: dict, figs: list | None = None) -> str:
    figs = figures(summary) if figs is None else figs
    par, fp = summary["parity"], summary["fingerprints"]
    n_failed = len(summary["failed_runs"])
    failed_text = f", {n_failed} run(s) did not finish" if n_failed else ""
    out = [f"# Framework comparison: {summary['name']}", "",
           f"Generated {summary['created_at']} by `harness compare`; results store `{summary['store']}`.", "",
           f"**Verdict: {'PASS' if summary['verdict'] == PASS else 'FAIL'}** - loss parity "
           f"{'holds' if par['verdict'] == PASS else 'FAILS'}"
           f"{failed_text}"
           f"; fingerprints {'identical' if fp['same'] else 'DIFFER (' + ', '.join(fp['flagged_groups']) + ')'}.",
           "", "## Workload (identical for every run)", "", _workload_text(summary["workload"]), "",
           f"Precision policy, the same for every run: {summary.get('precision_policy') or 'not recorded'}.", "",
           f"{summary['nproc']} processes per run (the reference: 1). Initial weights are generated from the seed, "
           "bit-identical for every engine; every data-parallel rank takes its contiguous slice of the same global "
           "batch.", ""]
    differing = differing_fields(summary)
    out += ["## Results", ""]
    if differing:
        out += [DIFFERS_TEXT.format(fields=", ".join(differing)), ""]
    out += ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in table_rows(summary):
        out.append("| " + " | ".join(str(row[k]).replace("|", "\\|") for k, _ in COLUMNS) + " |")
    out += ["", "Step time: median over the measured steps (warm-up excluded), each step the slowest rank's, "
            "with the 95% confidence interval of the median. MFU uses the PaLM convention (6N + 12·L·h·s FLOPs "
            "per token) counted by the harness from the model shape, not by a framework's profiler (DeepSpeed's "
            "flops profiler double-counts under ZeRO-3); n/a where the device has no datasheet peak (CPU). "
            "Peak memory: CUDA allocator peak, or peak RSS per process on CPU.", ""]
    if any(name in ("throughput", "step-times") for name, _, _ in figs):
        out += ["## Throughput and step times", "", FIGURES_TEXT, ""]
        out += _md_figures(figs, ("throughput", "step-times"), image_dir(summary))
    header, rows = layout_matrix(summary)
    out += ["## Layouts by engine", "", MATRIX_TEXT, ""] + _md_table(header, rows) + [""]
    header, rows = breakdown_rows(summary)
    out += ["## Where the step goes", "", BREAKDOWN_TEXT, ""] + _md_table(header, rows) + [""]
    header, rows = census_rows(summary)
    out += ["## Memory census", "", CENSUS_TEXT, ""] + _md_table(header, rows) + [""]
    if summary.get("threads_per_process"):
        out += [THREADS_TEXT.format(n=summary["threads_per_process"]), ""]
    load = summary.get("load_average") or {}
    if load.get("before"):
        out += [f"Machine load average (1/5/15 min) before the runs: {load['before']}, after: {load.get('after')} "
                f"({os.cpu_count()} logical CPUs here); a load above the core count means other work shared the "
                "machine and widened the step-time intervals.", ""]
    out += ["## Loss parity", "",
            f"The first {par['steps']} per-step losses (warm-up included) of every run are compared with the "
            f"{par['anchor_kind']} (`{par['anchor']}`). Tolerance: max relative difference "
            f"**{par['tolerance']:g}** ({summary['tolerance_source']}). Largest difference between any two "
            f"finished runs: {_sci(par['max_pairwise_rel_diff'])} "
            f"({'within' if par['cross_engine_ok'] else 'OUTSIDE'} tolerance).", ""]
    if any(name == "loss-curves" for name, _, _ in figs):
        out += [LOSS_FIGURE_TEXT, ""] + _md_figures(figs, ("loss-curves",), image_dir(summary))
    if summary.get("loss_table"):
        out += _md_table(*loss_rows(summary)) + [""]
    fails = [p for p in par["runs"] if p["verdict"] != PASS]
    if fails:
        out += ["Parity failures:", ""] + [f"- **{p['label']}**: {p['verdict']}"
                                           f"{' - ' + p['note'] if p['note'] else ''}" for p in fails] + [""]
    notes = policy_exceptions(summary)
    overrides = [(r["label"], r["workload_override"]) for r in summary["runs"] if r.get("workload_override")]
    if notes or overrides:
        out += ["## Where a run does not express the workload exactly", ""]
        out += [f"- {lab}: {note}" for lab, note in notes]
        out += [f"- {lab}: workload overridden in the compare spec: `{json.dumps(ov)}`" for lab, ov in overrides]
        out.append("")
    out += ["## Engines", ""]
    for r in summary["runs"]:
        d = r.get("describe") or {}
        if d:
            keep = {k: v for k, v in d.items() if k not in ("ds_config", "precision_policy")}  # policy: stated once
            out.append(f"- **{r['label']}** (launcher `{r['launcher']}`): " +
                       "; ".join(f"{k}: {v}" for k, v in keep.items() if not isinstance(v, (dict, list))))
    out.append("")
    if summary["skipped"]:
        out += ["## Not run", ""] + [f"- {lab}: {why}" for lab, why in summary["skipped"]] + [""]
    if summary["failed_runs"]:
        out += ["## Failed runs", ""]
        for r in summary["runs"]:
            if r["status"] != "ok":
                out += [f"- **{r['label']}**: {r['status']} (run {r['run_id']}, log `{r.get('log')}`)", "",
                        "```", (r.get("error") or "").strip()[-1500:], "```", ""]
    out += ["## Fingerprints", ""]
    if fp["same"]:
        out.append("Every run saw the same hosts, devices and library versions:")
    else:
        out.append(f"**Runs differ in {', '.join(fp['flagged_groups'])}** - the comparison is not on identical "
                   "hardware/software:")
        out += ["", "| Key | Group | " + " | ".join(d for d in fp["differences"][0]["values"]) + " |",
                "|---|---|" + "---|" * len(fp["differences"][0]["values"])]
        for d in fp["differences"]:
            out.append(f"| {d['key']} | {d['group']} | " + " | ".join(str(v) for v in d["values"].values()) + " |")
        out += ["", "Common to all runs:"]
    out += [""] + [f"- {k}: {v}" for k, v in fp["common"].items()] + [""]
    if fp["without_fingerprint"]:
        out += [f"Runs without a fingerprint (no record from the runner): {', '.join(fp['without_fingerprint'])}", ""]
    out += ["Run ids: " + ", ".join(f"{r['label']} `{r['run_id']}`" for r in summary["runs"]), ""]
    return "\n".join(out)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}th,td{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f0f0f0}.pass{color:#17692e;font-weight:bold}.FAIL,.fail{color:#b00020;font-weight:bold}
.nodata{color:#a15c00;font-weight:bold}pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:0.85em}
.verdict{font-size:1.3em;padding:8px;border-radius:4px;display:inline-block}
.vpass{background:#e3f5e8}.vfail{background:#fde7ea}code{background:#f3f3f3;padding:0 3px}
img{max-width:100%;height:auto;display:block;margin:.6em 0}"""


def _h(x) -> str:
    return html.escape(str(x))


def html_page(summary: dict, figs: list | None = None) -> str:
    figs = figures(summary) if figs is None else figs
    par, fp = summary["parity"], summary["fingerprints"]
    ok = summary["verdict"] == PASS
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Comparison {_h(summary['name'])}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>Framework comparison: {_h(summary['name'])}</h1>",
             f"<p>Generated {_h(summary['created_at'])} by <code>harness compare</code>; results store "
             f"<code>{_h(summary['store'])}</code>.</p>",
             f"<p class='verdict {'vpass' if ok else 'vfail'}'>Verdict: <b>{'PASS' if ok else 'FAIL'}</b> - loss "
             f"parity {'holds' if par['verdict'] == PASS else 'FAILS'}; {len(summary['failed_runs'])} failed run(s); "
             f"fingerprints {'identical' if fp['same'] else 'DIFFER: ' + _h(', '.join(fp['flagged_groups']))}</p>",
             "<h2>Workload (identical for every run)</h2>", f"<p>{_h(_workload_text(summary['workload']))}</p>",
             f"<p>Precision policy, the same for every run: {_h(summary.get('precision_policy') or 'not recorded')}.</p>",
             "<h2>Results</h2>"]
    differing = differing_fields(summary)
    if differing:
        parts.append(f"<p>{_h(DIFFERS_TEXT.format(fields=', '.join(differing)))}</p>")
    parts.append("<table><tr>" + "".join(f"<th>{_h(h)}</th>" for _, h in COLUMNS) + "</tr>")
    for row in table_rows(summary):
        cells = []
        for k, _ in COLUMNS:
            cls = ""
            if k == "parity":
                cls = {"pass": "pass", "FAIL": "fail", "no data": "nodata"}.get(row[k], "")
            if k == "status" and row[k] != "ok":
                cls = "fail"
            cells.append(f"<td class='{cls}'>{_h(row[k])}</td>")
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</table>")
    parts.append("<p>Step time: median of the measured steps (warm-up excluded; each step the slowest rank's) "
                 "with its 95% confidence interval. MFU: PaLM convention, FLOPs counted by the harness from the "
                 "model shape (not a framework profiler); n/a where the device has no datasheet peak.</p>")
    if any(name in ("throughput", "step-times") for name, _, _ in figs):
        parts.append(f"<h2>Throughput and step times</h2><p>{_h(FIGURES_TEXT)}</p>"
                     + _html_figures(figs, ("throughput", "step-times")))
    parts.append(f"<h2>Layouts by engine</h2><p>{_h(MATRIX_TEXT)}</p>" + _html_table(*layout_matrix(summary)))
    parts.append(f"<h2>Where the step goes</h2><p>{_h(BREAKDOWN_TEXT)}</p>" + _html_table(*breakdown_rows(summary)))
    parts.append(f"<h2>Memory census</h2><p>{_h(CENSUS_TEXT)}</p>" + _html_table(*census_rows(summary)))
    if summary.get("threads_per_process"):
        parts.append(f"<p>{_h(THREADS_TEXT.format(n=summary['threads_per_process']))}</p>")
    load = summary.get("load_average") or {}
    if load.get("before"):
        parts.append(f"<p>Machine load average (1/5/15 min) before the runs: {_h(load['before'])}, after: "
                     f"{_h(load.get('after'))}; above the core count, other work shared the machine.</p>")
    parts.append(f"<h2>Loss parity</h2><p>First {par['steps']} losses compared with the {_h(par['anchor_kind'])} "
                 f"(<code>{_h(par['anchor'])}</code>). Tolerance: max relative difference <b>{par['tolerance']:g}</b> "
                 f"({_h(summary['tolerance_source'])}). Largest pairwise difference: "
                 f"{_sci(par['max_pairwise_rel_diff'])}.</p>")
    if any(name == "loss-curves" for name, _, _ in figs):
        parts.append(f"<p>{_h(LOSS_FIGURE_TEXT)}</p>" + _html_figures(figs, ("loss-curves",)))
    if summary.get("loss_table"):
        parts.append(_html_table(*loss_rows(summary)))
    fails = [p for p in par["runs"] if p["verdict"] != PASS]
    if fails:
        parts.append("<p><b>Parity failures:</b></p><ul>" + "".join(
            f"<li class='fail'>{_h(p['label'])}: {_h(p['verdict'])} {_h(p['note'])}</li>" for p in fails) + "</ul>")
    notes = policy_exceptions(summary)
    overrides = [(r["label"], json.dumps(r["workload_override"])) for r in summary["runs"] if r.get("workload_override")]
    if notes or overrides:
        parts.append("<h2>Where a run does not express the workload exactly</h2><ul>" +
                     "".join(f"<li>{_h(a)}: {_h(b)}</li>" for a, b in notes) +
                     "".join(f"<li>{_h(a)}: workload overridden: <code>{_h(b)}</code></li>" for a, b in overrides) +
                     "</ul>")
    if summary["skipped"]:
        parts.append("<h2>Not run</h2><ul>" + "".join(f"<li>{_h(a)}: {_h(b)}</li>" for a, b in summary["skipped"])
                     + "</ul>")
    if summary["failed_runs"]:
        parts.append("<h2>Failed runs</h2>")
        for r in summary["runs"]:
            if r["status"] != "ok":
                parts.append(f"<p><b>{_h(r['label'])}</b>: {_h(r['status'])} (run {_h(r['run_id'])})</p>"
                             f"<pre>{_h((r.get('error') or '').strip()[-1500:])}</pre>")
    parts.append("<h2>Fingerprints</h2>")
    if not fp["same"]:
        labels = list(fp["differences"][0]["values"])
        parts.append(f"<p class='fail'>Runs differ in {_h(', '.join(fp['flagged_groups']))}.</p><table><tr><th>Key"
                     "</th><th>Group</th>" + "".join(f"<th>{_h(lab)}</th>" for lab in labels) + "</tr>")
        for d in fp["differences"]:
            parts.append(f"<tr><td>{_h(d['key'])}</td><td>{_h(d['group'])}</td>" +
                         "".join(f"<td>{_h(v)}</td>" for v in d["values"].values()) + "</tr>")
        parts.append("</table>")
    else:
        parts.append("<p>Every run saw the same hosts, devices and library versions.</p>")
    parts.append("<table>" + "".join(f"<tr><th>{_h(k)}</th><td>{_h(v)}</td></tr>" for k, v in fp["common"].items())
                 + "</table>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(summary: dict, out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"compare-{summary['name']}")
    paths = {"markdown": base + ".md", "html": base + ".html", "json": base + ".json"}
    figs = figures(summary)
    if figs:  # the Markdown links them; the HTML holds them inline
        img_dir = os.path.join(out_dir, image_dir(summary))
        os.makedirs(img_dir, exist_ok=True)
        for name, image, _ in figs:
            with open(os.path.join(img_dir, f"{name}.{plots.FORMAT}"), "wb") as f:
                f.write(image)
        paths["images"] = img_dir
    with open(paths["markdown"], "w") as f:
        f.write(markdown(summary, figs))
    with open(paths["html"], "w") as f:
        f.write(html_page(summary, figs))
    with open(paths["json"], "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True, default=str)
    return paths
