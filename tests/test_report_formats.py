"""What the reports say is defined once. A report's two formats say the same: every `## ` heading of
the Markdown is a heading of the HTML, in the same order, for the compare report and for the sweep
report (both are written from one list of sections by harness.report.render). A metric added once
to the record's fields (harness.store.fields) reaches the export and both reports. Built from
synthetic data, no processes."""

from __future__ import annotations

import html
import re

import pytest

from harness.compare.orchestrate import run_comparison
from harness.compare.spec import parse_compare_spec
from harness.report import analysis, render
from harness.report.build import sections_for
from harness.report.compare import results_table, write_report
from harness.report.data import choose_metric, to_row
from harness.store import ResultsStore, export, fields, new_record
from harness.testing.synthetic import make_records
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload(steps=3)


def _launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
    """What a runner records (launch.run_spec's stand-in); the run labelled 'broken' fails."""
    rec = new_record(spec, sweep=sweep, point_key=point_key)
    n, ok = spec["workload"]["steps"], point_key != "broken"
    rec.update(
        status="ok" if ok else "failed",
        error=None if ok else "RuntimeError: boom",
        fingerprint={"hosts": [point_key]},
        launch={"launcher": launcher, "log": f"{point_key}.log"},
    )
    if ok:
        rec["metrics"] = {
            "losses": [5.0] * (n + 1),
            "step_times_s": [0.01] * n,
            "tokens_per_s": 800.0,
            "step_time_s": {"median": 0.01, "ci95_low": 0.009, "ci95_high": 0.011, "n": n},
            "engine": {"optimizer": "AdamW", "precision_policy": "another policy"},
        }
        rec["metrics"].update(extra_metrics)
    ResultsStore(store_path).write(rec)
    return rec


extra_metrics: dict = {}  # what every record of _launch also measures


def headings(md: str, page: str) -> tuple[list[str], list[str]]:
    return (
        [line[3:] for line in md.splitlines() if line.startswith("## ")],
        [html.unescape(h) for h in re.findall(r"<h2>(.*?)</h2>", page)],
    )


def compare_summary(tmp_path) -> dict:
    cs = parse_compare_spec(
        {
            "name": "h",
            "nproc": 2,
            "parity_steps": 2,
            "workload": dict(WORKLOAD),
            "runs": [{"engine": "own", "dp": 2}, {"engine": "fsdp", "label": "broken", "workload": {"seed": 7}}],
        }
    )
    return run_comparison(cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=_launch)


def test_compare_report_markdown_headings_are_html_headings(tmp_path):
    summary = compare_summary(tmp_path)
    summary["skipped"] = [("deepspeed ZeRO-1", "engine deepspeed is not available")]
    paths = write_report(summary, str(tmp_path))
    md, page = headings(open(paths["markdown"]).read(), open(paths["html"]).read())
    assert md == page
    assert {
        "Results",
        "Throughput and step times",
        "Loss parity",
        "Engines",
        "Not run",
        "Failed runs",
        "Where a run does not express the workload exactly",
        "Fingerprints",
    } <= set(md)


def test_sweep_report_markdown_headings_are_html_headings():
    sections = sections_for(make_records(40, seed=1))
    md, page = headings(render.markdown("t", sections, "img"), render.html_page("t", sections))
    assert md == page and len(md) == len(sections)


def test_a_metric_added_once_reaches_the_export_and_every_report(tmp_path, monkeypatch):
    energy = fields.Field("energy_j", "energy", fields.at("metrics", "energy_j"), lambda v: f"{v:.0f} J")
    monkeypatch.setattr(fields, "FIELDS", (*fields.FIELDS, energy))
    monkeypatch.setitem(extra_metrics, "energy_j", 1234.0)
    records = make_records(20, seed=2)
    for rec in records:
        rec["metrics"]["energy_j"] = 1234.0

    csv = export(records, "csv").splitlines()
    assert csv[0].endswith(",energy_j") and all(line.endswith(",1234.0") for line in csv[1:])
    rows = [to_row(r) for r in records]
    best = analysis.best_layouts(rows, choose_metric(rows)).tables[0]
    assert best.headers[-2:] == ["energy", "run"] and {r[-2] for r in best.rows} == {"1234 J"}
    compare = results_table(compare_summary(tmp_path))
    col = compare.headers.index("energy")
    assert [r[col] for r in compare.rows] == ["1234 J", "1234 J", "-"]  # reference, own dp2, the failed run


@pytest.mark.parametrize("record", [{}, {"spec": None, "metrics": {"mfu": None, "losses": []}}, {"metrics": [1]}])
def test_fields_read_odd_records_as_missing(record):
    values = fields.row(record)
    assert set(values) == {f.name for f in fields.FIELDS} and all(v is None for v in values.values())
    assert {f.cell(None) for f in fields.FIELDS} == {"-"}
