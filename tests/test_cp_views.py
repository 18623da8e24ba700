"""Context parallelism in every view: the sweep report's tables, ablation and recommendations, the
compare report's breakdown and Why, the export and the end-of-run summary. Synthetic records, no
processes; a cp column or section appears only where some run uses cp > 1."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest
from conftest import profiled_record

from harness.compare.spec import load_compare_spec
from harness.report.build import sections_for
from harness.report.compare_steps import breakdown_rows, why_section
from harness.report.summary import summary_lines
from harness.store import export
from harness.testing.synthetic import make_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record(step: float, layout: dict, parts: dict, sweep: str = "cp") -> dict:
    lay = {
        "engine": "own",
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "cp": 1,
        "cp_impl": "ring",
        "micro_batch_size": 1,
        "activation_checkpointing": "none",
        "attention": "naive",
        "rmsnorm": "torch",
        **layout,
    }
    spec = {"workload": {"model": "tiny-256", "seq_len": 4096, "global_batch_size": 2}, "layout": lay}
    return profiled_record(spec, step, parts, 2, 1e6 / step, sweep=sweep, point_key=json.dumps(layout, sort_keys=True))


# dp2 against cp2 ring and cp2 ulysses at two ranks; the ring's step carries 30 ms of exposed cp traffic
CP_SWEEP = [
    record(100.0, {"dp": 2}, {"compute": 90.0, "exposed_comm": {"dp": 5.0}, "optimizer": 5.0}),
    record(130.0, {"cp": 2}, {"compute": 90.0, "exposed_comm": {"cp": 30.0, "dp": 5.0}, "optimizer": 5.0}),
    record(
        110.0,
        {"cp": 2, "cp_impl": "ulysses"},
        {"compute": 92.0, "exposed_comm": {"cp": 8.0, "dp": 5.0}, "optimizer": 5.0},
    ),
]


def by_id(records):
    return {s.id: s for s in sections_for(records)}


def test_sweep_report_names_cp_in_its_tables_ablation_and_recommendations():
    secs = by_id(CP_SWEEP)
    best = secs["best"].tables[0]
    assert best.headers[:5] == ["engine", "tp", "cp", "cp impl", "pp"]
    assert sorted(tuple(r[2:4]) for r in best.rows) == [("1", "-"), ("2", "ring"), ("2", "ulysses")]
    ablation = secs["context-parallel"]
    (t,) = ablation.tables
    assert [r[0] for r in t.rows] == ["cp1", "cp2 ring", "cp2 ulysses"]
    moved = " ".join(ablation.text)
    assert (
        "context parallel cp2 ring (own tp1 cp2 ring pp1 dp1" in moved and "exposed cp communication +30.0 ms" in moved
    )
    bd = secs["breakdown"].tables[0]
    assert "exposed cp communication" in bd.headers
    captions = [t.caption for t in secs["recommendations"].tables]
    assert any(c.startswith("context parallelism: cp1 was best in 1 of 1 comparison(s)") for c in captions)


def test_sweep_report_without_cp_has_no_cp_column_or_section():
    records = make_records(30, seed=3)
    secs = by_id(records)
    assert "context-parallel" not in secs
    assert "cp" not in secs["best"].tables[0].headers
    assert not any(t.caption.startswith("context parallelism") for t in secs["recommendations"].tables)
    old = [json.loads(json.dumps(r)) for r in records]  # written before cp existed: no cp, no cp_impl
    for r in old:
        r["spec"]["layout"].pop("cp", None)
        r["spec"]["layout"].pop("cp_impl", None)
    assert [s.id for s in sections_for(old)] == list(secs)


def compare_summary(runs: list[tuple[str, dict, float, dict]]) -> dict:
    return {
        "runs": [
            {
                "label": label,
                "layout": {"engine": "own", **lay},
                "status": "ok",
                "is_reference": False,
                "metrics": {"step_time_s": {"median": step / 1e3}},
                "breakdown_ms": {**parts, "step": step},
                "breakdown_source": "profiler",
            }
            for label, lay, step, parts in runs
        ]
    }


def test_compare_breakdown_and_why_name_exposed_cp_communication_only_where_a_run_had_it():
    summary = compare_summary(
        [
            ("own dp2", {"dp": 2}, 100.0, {"compute": 90.0, "exposed_comm": {"tp": 0.0, "dp": 5.0}, "optimizer": 5.0}),
            (
                "own cp2 ring",
                {"cp": 2},
                130.0,
                {"compute": 90.0, "exposed_comm": {"tp": 0.0, "cp": 30.0, "dp": 5.0}, "optimizer": 5.0},
            ),
        ]
    )
    header, rows = breakdown_rows(summary)
    # tp 1 in both runs: no tp column (an axis of degree 1 has none); dp on cp2 is its replica group's
    # (dp x cp), a column
    assert header[2:5] == ["compute", "exposed cp communication", "exposed dp communication"]
    assert [r[3] for r in rows] == ["-", "30.0 ms (23%)"]
    why = " ".join(i for b in why_section(summary).body if hasattr(b, "items") for i in b.items)
    assert (
        "own cp2 ring takes 30.0 ms more per measured step than own dp2 (median 130.0 against 100.0 ms); by the "
        "breakdowns (130.0 against 100.0 ms): exposed cp communication +30.0 ms (100% of the difference)."
    ) in why
    without = compare_summary([("own dp2", {"dp": 2}, 100.0, {"compute": 95.0, "exposed_comm": {"dp": 5.0}})])
    assert "exposed cp communication" not in breakdown_rows(without)[0]


def test_export_carries_cp_and_old_records_read_cp1():
    new = CP_SWEEP[1]
    old = json.loads(json.dumps(CP_SWEEP[0]))
    for key in ("cp", "cp_impl"):
        old["spec"]["layout"].pop(key)
    rows = list(csv.DictReader(io.StringIO(export([new, old, CP_SWEEP[0]], "csv"))))
    flat = [{k: r[k] for k in ("cp", "cp_impl", "breakdown_exposed_cp_ms")} for r in rows]
    assert flat[0] == {"cp": "2", "cp_impl": "ring", "breakdown_exposed_cp_ms": "30.0"}
    assert flat[1] == flat[2] == {"cp": "1", "cp_impl": "", "breakdown_exposed_cp_ms": ""}
    cols = list(rows[0])  # after the columns before them (later fields, fp8 and compile, come after)
    at = cols.index("cp")
    assert cols[at - 1 : at + 3] == ["diverged_at_step", "cp", "cp_impl", "breakdown_exposed_cp_ms"]


def test_summary_names_cp_only_with_context_parallelism():
    lay = CP_SWEEP[1]["spec"]["layout"]
    rec = {
        "run_id": "r",
        "status": "failed",
        "spec": {
            "workload": {"model": "m", "seq_len": 4096, "global_batch_size": 2, "precision": "fp32"},
            "layout": lay,
        },
    }
    assert "  layout:   engine own tp 1 cp 2 ring pp 1 dp 1 mbs 1" in "\n".join(summary_lines(rec, "s"))
    rec["spec"]["layout"] = {k: v for k, v in lay.items() if k not in ("cp", "cp_impl")}
    assert "  layout:   engine own tp 1 pp 1 dp 1 mbs 1" in "\n".join(summary_lines(rec, "s"))


@pytest.mark.parametrize("name", ["compare-cpu-long-seq.yaml"])
def test_long_sequence_example_plans_cp_runs_beside_cp1(name):
    cs = load_compare_spec(os.path.join(ROOT, "examples", name))
    planned = {r.label: r.spec.layout for r in cs.runs}
    refused = {n["label"]: n["why"] for n in cs.not_runnable}
    assert cs.workload["seq_len"] >= 1024 and cs.nproc == 2
    cps = {(lay.engine, lay.cp, lay.cp_impl if lay.cp > 1 else "") for lay in planned.values()}
    assert ("own", 1, "") in cps
    wanted = {("own", 2, "ring"), ("own", 2, "allgather"), ("own", 2, "ulysses"), ("deepspeed", 2, "ulysses")}
    assert wanted <= cps | {(label.split()[0], 2, label.split()[-1]) for label in refused}
    assert all(lay.dp * lay.cp * lay.tp * lay.pp == 2 for lay in planned.values() if lay.engine != "single")
