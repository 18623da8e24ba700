"""What fails while runs and sweeps run: a store that cannot take a record (it goes to a fallback
file; a disk that fills mid-sweep, on a real tmpfs where this machine lets the test mount one; a
read-only folder), the first rank to fail named ahead of its peers' echoes (from the records and
from the launchers' output; SIGKILL of a sweep during a torchrun and a deepspeed point leaves no
process of the run), and one instance of a sweep per store.

The quick tests work in-process with stand-ins; the slow ones run the real CLI and launchers.
Bad input refused before anything runs is tests/test_cli_errors.py.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time

import pytest
import yaml
from conftest import IN_PROCESS_SWEEP, ok_run_spec, run_cli, start_cli

from harness import launch
from harness.cli import main as cli_main
from harness.errors import StoreError
from harness.store import ResultsStore, fallback_paths, merge_failures, new_record
from harness.sweep.execute import run_sweep, sweep_id, sweep_lock
from harness.sweep.spec import parse_sweep

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
SWEEP = {"name": "s", "gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2]}}


def _record(run_id: str, status: str = "ok", **kw) -> dict:
    rec = new_record({"workload": {"model": "tiny"}, "layout": {"engine": "single"}}, **kw)
    rec.update(run_id=run_id, status=status, metrics={"tokens_per_s": 1.0})
    return rec


def _write(path, raw) -> str:
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return str(path)


def assert_one_line_error(r, start: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


# ---------------------------------------------------------------- a full disk, a read-only folder


def _failing_store(monkeypatch, after: int = 0):
    """Writes fail as on a full disk once `after` of them succeeded (sqlite's own error)."""
    real = ResultsStore._insert
    count = [0]

    def insert(self, record, keep):
        count[0] += 1
        if count[0] > after:
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, record, keep)

    monkeypatch.setattr(ResultsStore, "_insert", insert)
    return lambda: monkeypatch.setattr(ResultsStore, "_insert", real)


def test_a_record_the_store_cannot_take_goes_to_a_fallback_file(tmp_path, monkeypatch):
    path = str(tmp_path / "r.sqlite")
    store = ResultsStore(path)
    heal = _failing_store(monkeypatch)
    with pytest.raises(StoreError) as e:
        store.write(_record("r1"))
    assert e.value.reason == (
        f"cannot write run r1 to {path} (database or disk is full); the record is saved in {path}.fallback.jsonl, "
        "and the next harness command that opens this store merges it in"
    )
    assert store.get("r1")["status"] == "ok"  # the launcher still finds the runner's verdict
    heal()
    assert store.records() == [] and store.recover_fallback() == 1
    assert [r["run_id"] for r in store.records()] == ["r1"] and "fallback" not in store.get("r1")
    assert not any(os.path.exists(p) for p in fallback_paths(path))


def test_full_disk_stops_the_sweep_with_finished_points_intact_then_resumes(tmp_path, monkeypatch):
    """The sweep's part, with run_spec replaced by a stand-in that writes what a run writes; the
    disk fills after the first point (the slow test below does it on a real full tmpfs)."""
    spec = parse_sweep({**SWEEP, "grid": {"workload.seed": [1, 2, 3]}})
    path = str(tmp_path / "r.sqlite")
    ran = []
    monkeypatch.setattr(launch, "run_spec", ok_run_spec(ran))
    heal = _failing_store(monkeypatch, after=1)
    with pytest.raises(StoreError, match="the record is saved in"):
        run_sweep(spec, store_path=path, echo=lambda *a: None, **IN_PROCESS_SWEEP)
    assert len(ran) == 2  # the third point never started
    assert [r["point_key"] for r in ResultsStore(path).records(sweep="s")] == ran[:1]
    heal()
    lines = []
    assert run_sweep(spec, store_path=path, echo=lines.append, **IN_PROCESS_SWEEP)["ok"] == 1
    assert lines[0] == "merged 1 records that the store could not take earlier from its fallback file"
    keys = [r["point_key"] for r in ResultsStore(path).records(sweep="s")]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 3 and len(ran) == 3


# a real tmpfs (root) for disk faults


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A small tmpfs at `path`; skips the test where this machine does not let it mount one."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.mark.slow
def test_read_only_folder(tmp_path, tagged):
    with tmpfs(tmp_path / "ro", "1m") as folder:
        store = str(folder / "r.sqlite")
        ResultsStore(store).write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "r1"})
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        _write(tmp_path / "t.yaml", {"workload": TINY})
        _write(tmp_path / "s.yaml", {"gpus": 1, "workload": TINY})
        assert_one_line_error(tagged("train", "t.yaml", "--store", store), f"error: store: {store} is read-only")
        assert_one_line_error(
            tagged("sweep", "s.yaml", "--store", str(folder / "new.sqlite")),
            f"error: store: cannot create {folder}/new.sqlite: the folder {folder} is read-only",
        )
        r = tagged("results", "export", "--store", store)  # reading a read-only store works
        assert r.returncode == 0 and '"r1"' in r.stdout, r.stderr
        assert tagged.alive() == [] and os.listdir(folder) == ["r.sqlite"]


@pytest.mark.slow
def test_disk_that_fills_mid_sweep_stops_it_cleanly_and_loses_nothing(tmp_path, monkeypatch):
    """The store is on a 1 MiB tmpfs; once the first point's record is complete the test fills the
    disk, so the second point's records (the rank's and the launcher's) cannot be written: they go
    to the fallback file (in TMPDIR: next to the store is full too), the sweep stops with one error
    line, and after space is freed the same command merges them and runs nothing twice."""
    raw = {
        "name": "full",
        "gpus": 1,
        "timeout_s": 120,
        "workload": TINY,
        "layout": {"engine": "single"},
        "grid": {"workload.seed": [1, 2]},
    }
    path = _write(tmp_path / "s.yaml", raw)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where this process looks for the fallback file too
    with tmpfs(tmp_path / "disk", "1m") as disk:
        store = str(disk / "r.sqlite")
        args = [
            "sweep",
            path,
            "--store",
            store,
            "--launcher",
            "direct",
            "--no-progress",
            "--logs",
            str(tmp_path / "logs"),
        ]
        env = {**os.environ, "TMPDIR": str(tmp)}
        proc = start_cli(*args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and not any(
            "launch" in r for r in (ResultsStore(store).records() if os.path.exists(store) else [])
        ):
            time.sleep(0.1)
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 65536)
        os.close(fd)
        out, err = proc.communicate(timeout=180)
        lines = err.strip().splitlines()
        assert proc.returncode == 74 and "Traceback" not in out + err, err[-3000:]  # a fault, not a mistake
        assert lines[-1].startswith("error: store: cannot write run ") and "database or disk is full" in lines[-1]
        assert f"the record is saved in {tmp}" in lines[-1] and "the sweep stopped" in lines[-1]
        first = ResultsStore(store).records(sweep="full")
        assert len(first) == 1 and first[0]["status"] == "ok"
        saved = ResultsStore(store).fallback_records()
        assert len(saved) == 1 and next(iter(saved.values()))["launch"]["exit_code"] == 74
        spec = parse_sweep(raw)
        assert launch.processes_with_env(launch.SWEEP_ID_ENV, sweep_id(spec, store)) == []
        os.remove(disk / "filler")
        again = run_cli(*args, cwd=tmp_path, env=env, timeout=120)
        assert again.returncode == 0, again.stderr[-2000:]
        assert "merged 1 records" in again.stdout + again.stderr and "2 already recorded, 0 to run" in again.stdout
        recs = ResultsStore(store).records(sweep="full")
        assert sorted(collections.Counter(r["point_key"] for r in recs).values()) == [1, 1]
        assert all(r["status"] == "ok" and r["metrics"]["losses"] for r in recs)
        assert not any(os.path.exists(p) for p in fallback_paths(store))


# ---------------------------------------------------------------- the first rank to fail, kills


def _failure(rank, echo, status="failed", error="RuntimeError: x"):
    rec = _record("run", status=status)
    rec["rank_failures"] = [{"rank": rank, "status": status, "echo": echo, "error": error}]
    return rec


def test_an_echo_never_hides_the_cause_whichever_rank_writes_first():
    echo = _failure(1, True, error="RuntimeError: Connection reset by peer")
    cause = _failure(0, False, error="ValueError: bad")
    for first, second in ((echo, cause), (cause, echo)):
        kept = merge_failures(merge_failures(None, first), second)
        assert kept["rank_failures"][0]["rank"] == first["rank_failures"][0]["rank"]
        assert len(kept["rank_failures"]) == 2 and not kept["rank_failures"][0 if first is cause else 1]["echo"]
        assert launch.first_failure(kept, "")["rank"] == 0
    assert merge_failures(_failure(1, False), _failure(0, False, "oom"))["status"] == "oom"


TORCHRUN_TAIL = """
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_14:45:16
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 24570)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 24570
"""
DEEPSPEED_TAIL = (
    "harness.launch: local rank 1 (pid 12) exited with code 137\n"
    "harness.launch: local rank 0 (pid 11) exited with code 1\n"
    "[launch.py:259:sigkill_handler] [...'--local_rank=1'...] exits with return code = 1\n"
)


def test_first_failure_from_the_launchers_output():
    echo = _failure(1, True, error="RuntimeError: Connection reset by peer")
    assert launch.first_failure(echo, TORCHRUN_TAIL) == {
        "rank": 0,
        "exit_code": -9,
        "how": "killed by SIGKILL (exit code -9)",
        "source": "torchrun",
    }
    got = launch.first_failure(_failure(0, True), DEEPSPEED_TAIL)
    assert (got["rank"], got["how"]) == (1, "exit code 137 (128 + SIGKILL)")
    assert launch.first_failure_line(got).startswith("rank 1 failed first: exit code 137 (128 + SIGKILL)")
    assert launch.first_failure(echo, "RuntimeError: boom") is None


def _wait_for(cond, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_sigkill_of_a_sweep_leaves_no_process_and_the_killed_rank_is_the_first_failure(tmp_path, launcher):
    """The sweep's first point: rank 0 is SIGKILLed at step 1; its record must name rank 0 and the
    signal ahead of rank 1's "Connection reset by peer" (when rank 1 writes it before its launcher
    ends it). The second point hangs; the sweep is SIGKILLed while it runs: no process of it may be
    left (launcher, ranks), with nothing but the signals of its death to end them. A third
    combination is dropped, which the sweep says before it starts."""
    raw = {
        "name": f"kill-{launcher}",
        "gpus": 2,
        "timeout_s": 120,
        "workload": TINY,
        "layout": {"engine": "own"},
        "points": [
            {"workload.seed": 1, "env": {"HARNESS_FAULT": "kill:1:0"}},
            {"workload.seed": 2, "env": {"HARNESS_FAULT": "hang:1"}},
            {"workload.seed": 3, "micro_batch_size": 3},
        ],
    }
    path = _write(tmp_path / "s.yaml", raw)
    store = str(tmp_path / "r.sqlite")
    sid = sweep_id(parse_sweep(raw), store)
    err = open(tmp_path / "err.txt", "w+")
    args = ["sweep", path, "--store", store, "--no-progress", "--launcher", launcher]
    proc = start_cli(*args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(
            lambda: os.path.exists(store) and any("launch" in r for r in ResultsStore(store).records()),
            150,
            "the first point's record",
        )
        _wait_for(
            lambda: [
                p
                for p in launch.processes_with_env("HARNESS_FAULT", "hang:1")
                if p.environ().get(launch.SWEEP_ID_ENV) == sid and "RANK" in p.environ()
            ][1:],
            90,
            "the second point's two ranks",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # The run's processes end on signals (the parent-death SIGTERM, passed down the tree:
        # torchrun forwards it to its ranks, the fenced deepspeed launcher's handler ends them),
        # normally within a second or two; without them the hung ranks would stay until gloo's
        # 30-minute timeout. So the limit is a hang guard, far from the normal value.
        deadline = time.time() + 60
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
    assert note == [
        "note: sweep: 1 of 3 points dropped: workload.global_batch_size: 4 is not divisible by dp x "
        "micro_batch_size = 2 x 3; see --dry-run"
    ]


# ---------------------------------------------------------------- one sweep at a time


def test_second_instance_of_a_sweep_is_refused(no_launch, one_line_error):
    _write(no_launch / "s.yaml", SWEEP)
    store = str(no_launch / "r.sqlite")
    with sweep_lock(parse_sweep(SWEEP), store) as lock:
        assert open(lock).read().strip() == str(os.getpid())
        line = one_line_error(cli_main(["sweep", "s.yaml", "--store", store]))
        assert line == f"error: sweep: s is already running on {store} (pid {os.getpid()})"
    assert not os.path.exists(lock)  # released and removed
    with sweep_lock(parse_sweep(SWEEP), store):  # free again
        pass


@pytest.mark.slow
def test_a_second_instance_of_a_running_sweep_is_refused(tmp_path, tagged):
    raw = {
        "name": "twice",
        "gpus": 1,
        "workload": TINY,
        "layout": {"engine": "single"},
        "points": [{"env": {"HARNESS_FAULT": "hang:1"}}],
    }
    path = _write(tmp_path / "s.yaml", raw)
    store = str(tmp_path / "r.sqlite")
    sid = sweep_id(parse_sweep(raw), store)
    args = ["sweep", path, "--store", store, "--no-progress", "--launcher", "direct"]
    first = start_cli(*args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
