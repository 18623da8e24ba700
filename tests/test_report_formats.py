"""A report's two formats say the same: every `## ` heading of the Markdown is a heading of the HTML,
in the same order, for the compare report and for the sweep report (built from synthetic data, no
processes). Both are written from one list of sections (harness.report.render)."""

from __future__ import annotations

import html
import re

from harness.compare.orchestrate import run_comparison
from harness.compare.spec import parse_compare_spec
from harness.report import render
from harness.report.build import sections_for
from harness.report.compare import write_report
from harness.store import ResultsStore, new_record
from harness.testing.synthetic import make_records

WORKLOAD = {"model": "tiny", "seq_len": 32, "global_batch_size": 8, "steps": 3, "warmup_steps": 1,
            "device": "cpu", "precision": "fp32"}


def _launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
    """What a runner records (launch.run_spec's stand-in); the run labelled 'broken' fails."""
    rec = new_record(spec, sweep=sweep, point_key=point_key)
    n, ok = spec["workload"]["steps"], point_key != "broken"
    rec.update(status="ok" if ok else "failed", error=None if ok else "RuntimeError: boom",
               fingerprint={"hosts": [point_key]}, launch={"launcher": launcher, "log": f"{point_key}.log"})
    if ok:
        rec["metrics"] = {"losses": [5.0] * (n + 1), "step_times_s": [0.01] * n, "tokens_per_s": 800.0,
                          "step_time_s": {"median": 0.01, "ci95_low": 0.009, "ci95_high": 0.011, "n": n},
                          "engine": {"optimizer": "AdamW", "precision_policy": "another policy"}}
    ResultsStore(store_path).write(rec)
    return rec


def headings(md: str, page: str) -> tuple[list[str], list[str]]:
    return ([line[3:] for line in md.splitlines() if line.startswith("## ")],
            [html.unescape(h) for h in re.findall(r"<h2>(.*?)</h2>", page)])


def test_compare_report_markdown_headings_are_html_headings(tmp_path):
    cs = parse_compare_spec({"name": "h", "nproc": 2, "parity_steps": 2, "workload": dict(WORKLOAD),
                             "runs": [{"engine": "own", "dp": 2},
                                      {"engine": "fsdp", "label": "broken", "workload": {"seed": 7}}]})
    summary = run_comparison(cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=_launch)
    summary["skipped"] = [("deepspeed ZeRO-1", "engine deepspeed is not available")]
    paths = write_report(summary, str(tmp_path))
    md, page = headings(open(paths["markdown"]).read(), open(paths["html"]).read())
    assert md == page
    assert {"Results", "Throughput and step times", "Loss parity", "Engines", "Not run", "Failed runs",
            "Where a run does not express the workload exactly", "Fingerprints"} <= set(md)


def test_sweep_report_markdown_headings_are_html_headings():
    sections = sections_for(make_records(40, seed=1))
    md, page = headings(render.markdown("t", sections, "img"), render.html_page("t", sections))
    assert md == page and len(md) == len(sections)
