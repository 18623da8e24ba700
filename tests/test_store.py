"""The results store: transactions, one record per sweep point, failures that keep their cause."""

from harness.store import ResultsStore, export, new_record


def rec(status, run_id="r1", sweep=None, point=None, error=None):
    r = new_record({"workload": {"model": "tiny"}, "layout": {"engine": "own"}}, sweep=sweep, point_key=point)
    r.update(run_id=run_id, status=status, error=error)
    return r


def test_first_failure_of_a_run_is_kept_and_oom_wins(tmp_path):
    store = ResultsStore(str(tmp_path / "s.sqlite"))
    keep = {"keep_earlier_failure": True}  # how failing ranks write
    store.write(rec("oom", error="rank 0: CUDA out of memory"), **keep)
    store.write(rec("failed", error="rank 1: gloo Read error"), **keep)  # the peer's echo
    assert store.get("r1")["status"] == "oom"
    store.write(rec("failed", run_id="r2", error="rank 1: Read error"), **keep)
    store.write(rec("oom", run_id="r2", error="rank 0: CUDA out of memory"), **keep)
    assert store.get("r2")["status"] == "oom"
    enriched = store.get("r1")
    enriched["launch"] = {"exit_code": 1}
    store.write(enriched)  # the launcher adds what it saw to the same record
    assert store.get("r1")["launch"] == {"exit_code": 1}


def test_a_sweep_point_is_never_duplicated(tmp_path):
    store = ResultsStore(str(tmp_path / "s.sqlite"))
    store.write(rec("timeout", run_id="a", sweep="s", point="p1"))
    store.write(rec("ok", run_id="b", sweep="s", point="p1"))
    assert [r["run_id"] for r in store.records(sweep="s")] == ["b"]
    assert store.completed_points("s") == {"p1": "ok"}


def test_export_formats(tmp_path):
    store = ResultsStore(str(tmp_path / "s.sqlite"))
    store.write(rec("ok"))
    rows = export(store.records(), "csv").splitlines()
    assert rows[0].startswith("run_id,sweep,status") and rows[1].startswith("r1,,ok")
    assert export(store.records(), "jsonl").count("\n") == 1
