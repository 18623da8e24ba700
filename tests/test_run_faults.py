"""Faults through the real CLI (issue 15), slow tier: a representative subset of the bad inputs
of tests/test_faults.py, stores that cannot be used (a read-only folder, a disk that fills mid-
sweep: a real tmpfs where this machine lets the test mount one), SIGKILL of a sweep during a
torchrun and a deepspeed point (no process of the run survives; the killed rank is named as the
first failure, ahead of its peer's "Connection reset by peer"), and a second sweep instance.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import yaml

from harness import launch
from harness.store import ResultsStore, fallback_paths, new_record
from harness.sweep.execute import sweep_id
from harness.sweep.spec import parse_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
pytestmark = pytest.mark.slow


def _write(path, raw) -> str:
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return str(path)


@pytest.fixture
def tagged(tmp_path):
    """The real CLI with a tag in its environment that every process it starts inherits: after
    a refused input no process carrying it may exist (nothing launched)."""
    tag = uuid.uuid4().hex

    def run(*args, env=None, timeout=300):
        out = subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=tmp_path, capture_output=True,
                             text=True, timeout=timeout, env={**os.environ, "HARNESS_TEST_TAG": tag, **(env or {})})
        return out
    run.alive = lambda: launch.processes_with_env("HARNESS_TEST_TAG", tag)
    return run


def assert_one_line_error(r, start: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


CASES = [  # (id, files, argv, line start)
    ("sweep-all-dropped", {"s.yaml": {"gpus": 1, "workload": {**TINY, "model": "llama-7000b"},
                                      "grid": {"workload.seed": [1, 2]}}},
     ["sweep", "s.yaml"], "error: sweep: all 2 points were dropped (first: workload.model: unknown preset"),
    ("compare-timeout-negative", {"c.yaml": {"workload": {**TINY, "steps": 5}, "runs": [{"engine": "own", "dp": 2}]}},
     ["compare", "c.yaml", "--timeout", "-1"], "error: --timeout: must be a positive number"),
    ("sweep-store-int", {"s.yaml": {"gpus": 1, "workload": TINY, "store": 123}}, ["sweep", "s.yaml"],
     "error: sweep.store: must be a file path"),
    ("sweep-name-escapes", {"s.yaml": {"gpus": 1, "workload": TINY, "name": "../../x"}}, ["sweep", "s.yaml"],
     "error: sweep.name: '../../x'"),
    ("train-seq-len-1e12", {"t.yaml": "workload: {seq_len: 1e12, device: cpu}\n"}, ["train", "t.yaml"],
     "error: workload.seq_len: needs about "),
    ("train-empty-spec", {"t.yaml": ""}, ["train", "t.yaml"], "error: t.yaml: is empty"),
    ("train-wrong-dtype", {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin",
                                                                    "dtype": "uint32"}}},
                           "d.bin": "ab" * 4096, "d.bin.json": '{"dtype": "uint16", "vocab_size": 256}'},
     ["train", "t.yaml"], "error: workload.data.dtype: uint32, but d.bin.json"),
    ("plan-hardware-yaml", {"hw.yaml": "name: x\nmemory_gib: [1, 2\npeak: 3\n"},
     ["plan", "--model", "tiny", "--seq-len", "128", "--global-batch-size", "8", "--gpus", "8",
      "--hardware", "hw.yaml"],
     "error: --hardware: hw.yaml: not valid YAML: line 3, column 5"),
    ("train-store-not-sqlite", {"t.yaml": {"workload": TINY}, "r.sqlite": "a,b\n" * 100},
     ["train", "t.yaml", "--store", "r.sqlite"], "error: store: r.sqlite is not a readable results store"),
    ("sweep-store-directory", {"s.yaml": {"gpus": 1, "workload": TINY}}, ["sweep", "s.yaml", "--store", "."],
     "error: store: . is a directory"),
]


@pytest.mark.parametrize("files, argv, start", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_through_the_cli(tmp_path, tagged, files, argv, start):
    for name, content in files.items():
        _write(tmp_path / name, content)
    before = sorted(os.listdir(tmp_path))
    assert_one_line_error(tagged(*argv), start)
    assert sorted(os.listdir(tmp_path)) == before and tagged.alive() == []


def test_store_of_a_newer_schema_is_refused_before_a_run_and_unknown_records_are_left_out(tmp_path, tagged):
    store = str(tmp_path / "r.sqlite")
    ResultsStore(store).write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "old"})
    db = sqlite3.connect(store)
    db.execute("INSERT INTO runs (run_id, schema_version, status, record_json) VALUES ('new', 3, 'ok', "
               "'{\"run_id\": \"new\", \"schema_version\": 3, \"status\": \"ok\"}')")
    db.commit()
    r = tagged("results", "export", "--store", store)
    assert r.returncode == 0 and [json.loads(ln)["run_id"] for ln in r.stdout.splitlines()] == ["old"], r.stderr
    assert r.stderr.strip() == ("warning: store: left out 1 records this harness cannot read (1 with schema_version 3; "
                                "it reads schema_version 1)")
    db.execute("ALTER TABLE runs ADD COLUMN energy_j REAL")  # a newer harness's store
    db.commit()
    db.close()
    _write(tmp_path / "t.yaml", {"workload": TINY})
    line = assert_one_line_error(tagged("train", "t.yaml", "--store", store), "error: store: ")
    assert "energy_j" in line and tagged.alive() == []
    assert sqlite3.connect(store).execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 2  # nothing written


# ---------------------------------------------------------------- a real tmpfs (root) for disk faults

@contextlib.contextmanager
def tmpfs(path, size: str):
    """A small tmpfs at `path`; skips the test where this machine does not let it mount one."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_read_only_folder(tmp_path, tagged):
    with tmpfs(tmp_path / "ro", "1m") as folder:
        store = str(folder / "r.sqlite")
        ResultsStore(store).write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "r1"})
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        _write(tmp_path / "t.yaml", {"workload": TINY})
        _write(tmp_path / "s.yaml", {"gpus": 1, "workload": TINY})
        assert_one_line_error(tagged("train", "t.yaml", "--store", store),
                              f"error: store: {store} is read-only")
        assert_one_line_error(tagged("sweep", "s.yaml", "--store", str(folder / "new.sqlite")),
                              f"error: store: cannot create {folder}/new.sqlite: the folder {folder} is read-only")
        r = tagged("results", "export", "--store", store)  # reading a read-only store works
        assert r.returncode == 0 and "\"r1\"" in r.stdout, r.stderr
        assert tagged.alive() == [] and os.listdir(folder) == ["r.sqlite"]


def test_disk_that_fills_mid_sweep_stops_it_cleanly_and_loses_nothing(tmp_path, monkeypatch):
    """The store is on a 1 MiB tmpfs; once the first point's record is complete the test fills the
    disk, so the second point's records (the rank's and the launcher's) cannot be written: they go
    to the fallback file (in TMPDIR: next to the store is full too), the sweep stops with one error
    line, and after space is freed the same command merges them and runs nothing twice."""
    raw = {"name": "full", "gpus": 1, "timeout_s": 120, "workload": TINY, "layout": {"engine": "single"},
           "grid": {"workload.seed": [1, 2]}}
    path = _write(tmp_path / "s.yaml", raw)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where this process looks for the fallback file too
    with tmpfs(tmp_path / "disk", "1m") as disk:
        store = str(disk / "r.sqlite")
        args = ["sweep", path, "--store", store, "--launcher", "direct", "--no-progress",
                "--logs", str(tmp_path / "logs")]
        env = {**os.environ, "TMPDIR": str(tmp)}
        proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and not any(
                "launch" in r for r in (ResultsStore(store).records() if os.path.exists(store) else [])):
            time.sleep(0.1)
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 65536)
        os.close(fd)
        out, err = proc.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and "Traceback" not in out + err, err[-3000:]
        assert lines[-1].startswith("error: store: cannot write run ") and "database or disk is full" in lines[-1]
        assert f"the record is saved in {tmp}" in lines[-1] and "the sweep stopped" in lines[-1]
        first = ResultsStore(store).records(sweep="full")
        assert len(first) == 1 and first[0]["status"] == "ok"
        saved = ResultsStore(store).fallback_records()
        assert len(saved) == 1 and next(iter(saved.values()))["launch"]["exit_code"] == 2
        spec = parse_sweep(raw)
        assert launch.processes_with_env(launch.SWEEP_ID_ENV, sweep_id(spec, store)) == []
        os.remove(disk / "filler")
        again = subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "merged 1 records" in again.stdout and "2 already recorded, 0 to run" in again.stdout
        recs = ResultsStore(store).records(sweep="full")
        assert sorted(collections.Counter(r["point_key"] for r in recs).values()) == [1, 1]
        assert all(r["status"] == "ok" and r["metrics"]["losses"] for r in recs)
        assert not any(os.path.exists(p) for p in fallback_paths(store))


# ---------------------------------------------------------------- kills, first failures, a second instance

def _wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_sigkill_of_a_sweep_leaves_no_process_and_the_killed_rank_is_the_first_failure(tmp_path, launcher):
    """Point 0: rank 0 is SIGKILLed at step 1; its record must name rank 0 and the signal ahead of
    rank 1's "Connection reset by peer" (when rank 1 writes it before its launcher ends it).
    Point 1 hangs; the sweep is SIGKILLed while it runs:
    within a few seconds no process of it may be left (launcher, ranks). A third combination is
    dropped, which the sweep says before it starts."""
    raw = {"name": f"kill-{launcher}", "gpus": 2, "timeout_s": 120, "workload": TINY, "layout": {"engine": "own"},
           "points": [{"workload.seed": 1, "env": {"HARNESS_FAULT": "kill:1:0"}},
                      {"workload.seed": 2, "env": {"HARNESS_FAULT": "hang:1"}},
                      {"workload.seed": 3, "micro_batch_size": 3}]}
    path = _write(tmp_path / "s.yaml", raw)
    store = str(tmp_path / "r.sqlite")
    sid = sweep_id(parse_sweep(raw), store)
    err = open(tmp_path / "err.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "sweep", path, "--store", store, "--no-progress",
                             "--launcher", launcher], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(lambda: os.path.exists(store) and any("launch" in r for r in ResultsStore(store).records()),
                  150, "the first point's record")
        _wait_for(lambda: [p for p in launch.processes_with_env("HARNESS_FAULT", "hang:1")
                           if p.environ().get(launch.SWEEP_ID_ENV) == sid and "RANK" in p.environ()][1:],
                  90, "the second point's two ranks")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed_at = time.time()
        deadline = killed_at + 10  # "no process of a run may outlive its sweep by more than a few seconds"
        while time.time() < deadline and launch.processes_with_env(launch.SWEEP_ID_ENV, sid):
            time.sleep(0.2)
        left = launch.processes_with_env(launch.SWEEP_ID_ENV, sid)
        assert left == [], [(p.pid, p.cmdline()[:5]) for p in left]
    finally:
        proc.kill()
        launch.terminate(launch.processes_with_env(launch.SWEEP_ID_ENV, sid), 1.0)
    recs = ResultsStore(store).records(sweep=raw["name"])
    assert len(recs) == 1 and recs[0]["spec"]["workload"]["seed"] == 1  # the completed point, once
    first = recs[0]["error"].splitlines()[0]
    assert recs[0]["status"] == "failed" and first.startswith("rank 0 failed first: killed by SIGKILL"), first
    assert recs[0]["first_failure"]["rank"] == 0  # rank 1's echo, if it wrote one before it was ended, follows
    err.seek(0)
    note = [ln for ln in err.read().splitlines() if ln.startswith("note: sweep: ")]
    assert note == ["note: sweep: 1 of 3 points dropped: workload.global_batch_size: 4 is not divisible by dp x "
                    "micro_batch_size = 2 x 3; see --dry-run"]


def test_a_second_instance_of_a_running_sweep_is_refused(tmp_path, tagged):
    raw = {"name": "twice", "gpus": 1, "workload": TINY, "layout": {"engine": "single"},
           "points": [{"env": {"HARNESS_FAULT": "hang:1"}}]}
    path = _write(tmp_path / "s.yaml", raw)
    store = str(tmp_path / "r.sqlite")
    sid = sweep_id(parse_sweep(raw), store)
    first = subprocess.Popen([sys.executable, "-m", "harness.cli", "sweep", path, "--store", store, "--no-progress",
                              "--launcher", "direct"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        _wait_for(lambda: launch.processes_with_env(launch.SWEEP_ID_ENV, sid), 60, "the first instance's run")
        second = tagged("sweep", path, "--store", store, "--launcher", "direct")
        assert_one_line_error(second, f"error: sweep: twice is already running on {store} (pid {first.pid})")
        owners = {p.environ().get(launch.SWEEP_PID_ENV) for p in launch.processes_with_env(launch.SWEEP_ID_ENV, sid)}
        assert owners == {str(first.pid)} and tagged.alive() == []  # the second one started nothing
    finally:
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=60)
    assert first.returncode == 130, out
    assert launch.processes_with_env(launch.SWEEP_ID_ENV, sid) == [] and ResultsStore(store).records() == []
