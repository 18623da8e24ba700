"""A failed run says why: the first `error:` line a rank prints leads the record's error, ahead of
the launcher's summary, and every view shows it (the sweep's console line, the report's failures
table, the compare report's note)."""

from __future__ import annotations

import os

import pytest
from conftest import IN_PROCESS_SWEEP

from harness import launch
from harness.store import SCHEMA_VERSION, ResultsStore
from harness.testing.workloads import tiny_workload

REFUSAL = "error: layout.attention: flash2 needs a CUDA device; this machine has none"
WORKLOAD = tiny_workload()


def _refusing_module(tmp_path) -> dict:
    """A stand-in runner that prints what harness.cli prints on a refused preflight, and exits 2."""
    pkg = tmp_path / "mods"
    pkg.mkdir(exist_ok=True)
    (pkg / "refuse_run.py").write_text(
        "import sys\nprint('loading spec', flush=True)\n"
        f"print({REFUSAL!r}, file=sys.stderr, flush=True)\n"
        "print('error: a later line, not the cause', file=sys.stderr)\nsys.exit(2)\n"
    )
    return {"PYTHONPATH": str(pkg) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.mark.slow  # the stand-in runner is a process
def test_launch_carries_the_first_error_line_into_the_record(tmp_path):
    store = str(tmp_path / "r.sqlite")
    spec = {"workload": dict(WORKLOAD), "layout": {"attention": "flash2"}}
    rec = launch.run_spec(
        spec,
        nproc=1,
        launcher="direct",
        store_path=store,
        timeout_s=60,
        extra_env=_refusing_module(tmp_path),
        log_dir=str(tmp_path / "logs"),
        module="refuse_run",
    )
    assert rec["status"] == "failed" and rec["launch"]["exit_code"] == 2
    assert rec["error_line"] == REFUSAL
    assert rec["error"].startswith(REFUSAL + "\n")
    stored = ResultsStore(store).get(rec["run_id"])
    assert stored["error_line"] == REFUSAL and stored["error"].startswith(REFUSAL)


def test_first_error_line_and_its_lead_over_the_launcher_summary():
    out = "\n".join(["W1130 warning", "[rank0]: " + REFUSAL, "error: second", "  exitcode  : 2 (pid: 9)"])
    assert launch.first_error_line(out) == REFUSAL
    assert launch.first_error_line("RuntimeError: x\nexitcode: 2") == ""
    rec = {"status": "failed", "error": "rank 0 failed first: exit code 2, per torchrun\n---\nexitcode: 2"}
    launch.lead_with_error_line(rec, out)
    assert rec["error"].splitlines()[0] == REFUSAL and "per torchrun" in rec["error"]
    ok = {"status": "ok", "error": None}
    launch.lead_with_error_line(ok, out)
    assert "error_line" not in ok


def test_every_view_shows_the_error_line(tmp_path, monkeypatch):
    from harness.report import analysis
    from harness.report.data import to_row
    from harness.sweep.execute import run_sweep
    from harness.sweep.spec import parse_sweep

    def refused(spec, **kw):  # what run_spec returns for a refused run
        rec = {
            "schema_version": SCHEMA_VERSION,
            "run_id": "r1" + kw["point_key"],
            "status": "failed",
            "spec": spec,
            "sweep": kw["sweep"],
            "point_key": kw["point_key"],
            "error_line": REFUSAL,
            "error": "rank 0 failed first: exit code 2, per torchrun\n---\n" + REFUSAL,
            "launch": {"exit_code": 2},
        }
        ResultsStore(kw["store_path"]).write(rec)
        return rec

    monkeypatch.setattr(launch, "run_spec", refused)
    lines = []
    sweep = parse_sweep({"name": "s", "gpus": 1, "workload": dict(WORKLOAD), "layout": {"attention": "flash2"}})
    store = str(tmp_path / "r.sqlite")
    counts = run_sweep(sweep, store_path=store, echo=lines.append, log_dir=str(tmp_path / "logs"), **IN_PROCESS_SWEEP)
    assert counts["failed"] == 1
    (rec,) = [r for r in ResultsStore(store).records() if r.get("sweep") == "s"]
    row = to_row(rec)
    assert row.reason == REFUSAL
    table = analysis.failures([row]).tables[0]
    assert table.rows[0][3] == REFUSAL

    # the compare report's note
    from harness.compare.orchestrate import run_comparison
    from harness.compare.spec import parse_compare_spec
    from harness.report.compare import write_report

    cs = parse_compare_spec(
        {
            "name": "t",
            "nproc": 2,
            "parity_steps": 2,
            "workload": dict(WORKLOAD),
            "runs": [{"engine": "own", "attention": "flash2"}],
        }
    )

    def fake(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        return refused(spec, store_path=store_path, sweep=sweep, point_key=point_key)

    summary = run_comparison(cs, store_path=str(tmp_path / "c.sqlite"), progress=False, launch_fn=fake)
    assert all(r["error_line"] == REFUSAL for r in summary["runs"])
    md = open(write_report(summary, str(tmp_path / "rep"))["markdown"]).read()
    assert REFUSAL in md.split("## Loss parity")[0]


def test_sweep_console_line_names_the_error_line(tmp_path, monkeypatch, capsys):
    from harness.sweep import execute
    from harness.sweep.spec import parse_sweep

    def refused(spec, **kw):
        rec = {
            "run_id": "r1",
            "status": "failed",
            "spec": spec,
            "sweep": kw["sweep"],
            "point_key": kw["point_key"],
            "error_line": REFUSAL,
            "error": "exitcode: 2\n" + REFUSAL,
        }
        ResultsStore(kw["store_path"]).write(rec)
        return rec

    monkeypatch.setattr(launch, "run_spec", refused)
    sweep = parse_sweep({"name": "s", "gpus": 1, "workload": dict(WORKLOAD)})
    execute.run_sweep(
        sweep,
        launcher="direct",
        store_path=str(tmp_path / "r.sqlite"),
        timeout_s=60,
        progress=True,
        echo=lambda *_: None,
        log_dir=str(tmp_path / "logs"),
    )
    out = capsys.readouterr()
    assert "failed  " in out.out + out.err and REFUSAL in out.out + out.err


@pytest.mark.slow
def test_a_real_refused_run_under_torchrun_records_its_cause(tmp_path):
    """The real runner under torchrun: an attention kernel this CPU machine cannot run."""
    store = str(tmp_path / "r.sqlite")
    spec = {"workload": dict(WORKLOAD), "layout": {"attention": "flash2"}}
    rec = launch.run_spec(
        spec, nproc=1, launcher="torchrun", store_path=store, timeout_s=240, log_dir=str(tmp_path / "logs")
    )
    assert rec["status"] == "failed"
    assert rec["error_line"].startswith("error: layout.attention"), rec["error"]
    assert rec["error"].startswith(rec["error_line"])
