"""Faults, fast tier (issue 15): every bad input is one line `error: <field>: ...`, exit code 2,
before anything launches; stores that cannot be used are refused, records they cannot take are
kept in a fallback file; the first rank to fail is named; one sweep runs once per store.

These call harness.cli.main in-process (the code path of `python -m harness.cli`, without paying
for a Python start per case) with subprocess.Popen replaced by a trap, so a launch fails the test;
tests/test_faults_cli.py runs a representative subset, the kills, locks and disk faults through
the real CLI.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess

import pytest
import yaml

from harness import launch
from harness.cli import main as cli_main
from harness.errors import SpecError, StoreError
from harness.spec import parse_spec
from harness.store import ResultsStore, fallback_paths, merge_failures, new_record
from harness.sweep.execute import run_sweep, sweep_lock
from harness.sweep.spec import parse_sweep

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
COMPARE = {"name": "c", "workload": {**TINY, "steps": 5}, "runs": [{"engine": "own", "dp": 2}]}
SWEEP = {"name": "s", "gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2]}}
PLAN = ["plan", "--model", "tiny", "--seq-len", "128", "--global-batch-size", "8", "--gpus", "8"]
BIG = {"workload": {**TINY, "seq_len": 10**12}}

# (id, argv, files to write, the line's start, a part of the reason)
BAD_INPUTS = [
    # 1. a sweep that would run nothing
    ("sweep-all-dropped-unknown-model", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "workload": {**TINY, "model": "x"}}},
     "error: sweep: all 2 points were dropped (first: workload.model: unknown preset 'x'", "; see --dry-run"),
    ("sweep-all-dropped-typo", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "workload": {**TINY, "seqlen": 8}}},
     "error: sweep: all 2 points were dropped (first: workload.seqlen: unknown key", "see --dry-run"),
    # 6. inputs that passed or crashed
    ("compare-timeout-negative", ["compare", "c.yaml", "--timeout", "-1"], {"c.yaml": COMPARE},
     "error: --timeout: ", "must be a positive number"),
    ("compare-timeout-zero", ["compare", "c.yaml", "--timeout", "0"], {"c.yaml": COMPARE},
     "error: --timeout: ", "positive"),
    ("compare-timeout-nan", ["compare", "c.yaml", "--timeout", "nan"], {"c.yaml": COMPARE},
     "error: --timeout: ", "positive"),
    ("sweep-timeout-zero", ["sweep", "s.yaml", "--timeout", "0"], {"s.yaml": SWEEP}, "error: --timeout: ", "positive"),
    ("compare-store-int", ["compare", "c.yaml"], {"c.yaml": {**COMPARE, "store": 123}}, "error: store: ", "file path"),
    ("sweep-store-int", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "store": 123}}, "error: sweep.store: ", "file path"),
    ("compare-reference-string", ["compare", "c.yaml"], {"c.yaml": {**COMPARE, "reference": "no"}},
     "error: reference: ", "must be true or false"),
    ("sweep-point-timeout-word", ["sweep", "s.yaml", "--dry-run"],
     {"s.yaml": {**SWEEP, "points": [{"workload.seed": 3, "timeout_s": "fast"}]}},
     "error: sweep.points[0].timeout_s: ", "positive number"),
    ("sweep-name-escapes", ["sweep", "s.yaml", "--dry-run"], {"s.yaml": {**SWEEP, "name": "../../x"}},
     "error: sweep.name: ", "no '/'"),
    ("sweep-name-slash", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "name": "a/b"}}, "error: sweep.name: ", "no '/'"),
    ("sweep-name-dotdot", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "name": ".."}}, "error: sweep.name: ", "'..'"),
    ("sweep-name-too-long", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "name": "x" * 300}},
     "error: sweep.name: ", "300 bytes"),
    ("compare-name-too-long", ["compare", "c.yaml"], {"c.yaml": {**COMPARE, "name": "x" * 250}},
     "error: name: ", "bytes"),
    ("train-seq-len-1e12-int", ["train", "t.yaml"], {"t.yaml": BIG}, "error: workload.seq_len: needs about ",
     "PiB per device"),
    ("compare-seq-len-1e12", ["compare", "c.yaml"], {"c.yaml": {**COMPARE, "workload": {**TINY, "seq_len": 10**12}}},
     "error: workload.seq_len: needs about ", "PiB"),
    ("export-out-missing-folder", ["results", "export", "--store", "r.sqlite", "--out", "nope/x.jsonl"],
     {"r.sqlite": None}, "error: --out: ", "does not exist"),
    ("export-out-is-folder", ["results", "export", "--store", "r.sqlite", "--out", "."], {"r.sqlite": None},
     "error: --out: ", "is a folder"),
    ("report-out-is-file", ["report", "--store", "r.sqlite", "--out", "t.yaml"], {"r.sqlite": None, "t.yaml": "x: 1\n"},
     "error: --out: ", "is a file"),
    ("report-out-missing-parent", ["report", "--store", "r.sqlite", "--out", "no/such/dir"], {"r.sqlite": None},
     "error: --out: ", "does not exist"),
    ("compare-out-is-file", ["compare", "c.yaml", "--out", "c.yaml"], {"c.yaml": COMPARE},
     "error: --out: ", "is a file"),
    ("data-prepare-out-missing-folder", ["data", "prepare", "t.txt", "--out", "no/x.bin"], {"t.txt": "hello"},
     "error: --out: ", "does not exist"),
    ("train-peak-negative", ["train", "t.yaml", "--peak-tflops", "-5"], {"t.yaml": {"workload": TINY}},
     "error: --peak-tflops: ", "positive"),
    ("plan-gpus-per-node-zero", PLAN + ["--gpus-per-node", "0"], {}, "error: --gpus-per-node: ", "at least 1"),
    ("report-timeline-unknown-run", ["report", "--store", "r.sqlite", "--out", "rep", "--timeline-run", "zzz"],
     {"r.sqlite": None}, "error: --timeline-run: ", "'zzz' is the start of no run ids"),
    ("report-timeline-ambiguous", ["report", "--store", "r.sqlite", "--out", "rep", "--timeline-run", "run-"],
     {"r.sqlite": None}, "error: --timeline-run: ", "2 run ids"),
    ("train-empty-spec", ["train", "e.yaml"], {"e.yaml": ""}, "error: e.yaml: ", "is empty"),
    ("compare-empty-spec", ["compare", "e.yaml"], {"e.yaml": "# only a comment\n"}, "error: e.yaml: ", "is empty"),
    ("sweep-empty-spec", ["sweep", "e.yaml"], {"e.yaml": "\n"}, "error: e.yaml: ", "is empty"),
    ("plan-hardware-yaml-malformed", PLAN + ["--hardware", "hw.yaml"],
     {"hw.yaml": "name: x\nmemory_gib: [1, 2\npeak: 3\n"},
     "error: --hardware: hw.yaml: not valid YAML: line 3, column 5: ", "expected ','"),
    # 7. wrong data
    ("data-dtype-differs-from-prepare", ["train", "t.yaml"],
     {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin", "dtype": "uint32"}}},
      "d.bin": b"\x01\x00" * 4096, "d.bin.json": {"tokens": 4096, "dtype": "uint16", "vocab_size": 256}},
     "error: workload.data.dtype: ", "says the file holds uint16 tokens"),
    ("data-odd-bytes-uint16", ["train", "t.yaml"],
     {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01" * 4097},
     "error: workload.data.path: ", "4097 bytes, not a whole number of uint16 tokens"),
    ("data-shorter-than-a-batch", ["train", "t.yaml"],
     {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01\x00" * 100},
     "error: workload.data.path: ", "holds 100 tokens, fewer than one global batch of 4 x (seq_len 32 + 1) = 132"),
    ("data-vocab-larger-than-model", ["train", "t.yaml"],
     {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01\x00" * 4096,
      "d.bin.json": {"tokens": 4096, "dtype": "uint16", "vocab_size": 32000}},
     "error: workload.data.path: ", "vocabulary of 32000"),
    ("sweep-data-all-dropped", ["sweep", "s.yaml"],
     {"s.yaml": {**SWEEP, "workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01" * 11},
     "error: sweep: all 2 points were dropped (first: workload.data.path: ", "11 bytes"),
]

# `harness train t.yaml` with t.yaml as written: (its text, the line's start, a part of the reason)
TRAIN_YAML = {
    "seq-len-1e12-yaml-string": ("workload: {seq_len: 1e12}", "workload.seq_len: needs about ", "more than any"),
    "layers-1e9": ("workload: {model_overrides: {layers: 1e9}}", "workload.model_overrides: needs ", "4.62e+13"),
    "layers-1e9-float": ("workload: {model_overrides: {layers: 1.0e+9}}", "workload.model_overrides: ", "TiB"),
    "layers-fraction": ("workload: {model_overrides: {layers: 2.5}}", "workload.model_overrides.layers: ", "integer"),
    "spec-yaml-malformed": ("workload: [unclosed", "t.yaml: not valid YAML: line 2, column 1: ", "expected ','"),
    "lr-nan": ("workload: {optimizer: {lr: .nan}}", "workload.optimizer.lr: ", "must be a finite number"),
    "lr-word": ("workload: {optimizer: {lr: fast}}", "workload.optimizer.lr: ", "must be a number"),
}
BAD_INPUTS += [(f"train-{name}", ["train", "t.yaml"], {"t.yaml": text + "\n"}, "error: " + start, reason)
               for name, (text, start, reason) in TRAIN_YAML.items()]


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """Run in tmp_path with every process start trapped: a launch fails the test."""
    def trap(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", trap)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _write_files(root, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        if content is None:  # a store holding two records whose run ids start with "run-"
            store = ResultsStore(str(path))
            for i in range(2):
                store.write(_record(f"run-{i}"))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else
                            (json.dumps(content) if name.endswith(".json") else yaml.safe_dump(content)))


def _record(run_id: str, status: str = "ok", **kw) -> dict:
    rec = new_record({"workload": {"model": "tiny"}, "layout": {"engine": "single"}}, **kw)
    rec.update(run_id=run_id, status=status, metrics={"tokens_per_s": 1.0})
    return rec


def one_line_error(capsys, rc: int) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, captured.err, captured.out[-500:])
    return lines[0]


@pytest.mark.parametrize("argv, files, start, reason", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_nothing_launches(no_launch, capsys, argv, files, start, reason):
    _write_files(no_launch, files)
    before = sorted(os.listdir(no_launch))
    line = one_line_error(capsys, cli_main(list(argv)))
    assert line.startswith(start) and reason in line, line
    assert sorted(os.listdir(no_launch)) == before  # no store, no logs, no report: nothing was written


def test_numbers_as_users_write_them():
    """YAML 1.1 reads `1e-4` and `1e3` as strings: numeric strings are numbers in number fields."""
    spec = parse_spec(yaml.safe_load("workload: {optimizer: {lr: 1e-4, eps: 1e-8}, seq_len: 1e2, "
                                     "model_overrides: {layers: '4'}}"))
    assert spec.workload.optimizer.lr == 1e-4 and spec.workload.optimizer.eps == 1e-8
    assert spec.workload.seq_len == 100 and isinstance(spec.workload.seq_len, int)
    assert spec.workload.model_overrides == {"layers": 4}


def test_partly_dropped_sweep_says_how_many_and_why_before_it_runs(no_launch, capsys, monkeypatch):
    import harness.commands.sweep as sweep_cmd

    ran = []
    monkeypatch.setattr(sweep_cmd, "run_sweep", lambda spec, **kw: ran.append(spec.name) or {"ok": 2})
    _write_files(no_launch, {"s.yaml": {**SWEEP, "grid": {"micro_batch_size": [1, 2, 3, 8]},
                                        "exclude": [{"micro_batch_size": 2}]}})
    assert cli_main(["sweep", "s.yaml"]) == 0 and ran == ["s"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["note: sweep: 1 of 4 points dropped: excluded by exclude[0] {'micro_batch_size': 2}; see --dry-run",
                   "note: sweep: 2 of 4 points dropped: workload.global_batch_size: 4 is not divisible by dp x "
                   "micro_batch_size = 1 x 3 (and 1 more like it); see --dry-run"]


# ---------------------------------------------------------------- 3. stores

def _foreign_sqlite(path):
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE people (name TEXT)")
    db.commit()
    db.close()


def _newer_columns(path):
    ResultsStore(path).write(_record("old"))
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE runs ADD COLUMN energy_j REAL")
    db.commit()
    db.close()


def _newer_version(path):
    ResultsStore(path)
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 7")
    db.close()


STORE_FAULTS = {
    "not-sqlite": (lambda p: open(p, "w").write("results,of,a,spreadsheet\n" * 50), "is not a readable results store"),
    "directory": (os.mkdir, "is a directory, not a results file"),
    "foreign-sqlite": (_foreign_sqlite, "without a runs table"),
    "newer-schema-column": (_newer_columns, "columns this harness does not know (energy_j)"),
    "newer-schema-version": (_newer_version, "store schema 7"),
}
STORE_COMMANDS = {
    "train": ["train", "t.yaml", "--store", "S"],
    "compare": ["compare", "c.yaml", "--store", "S"],
    "sweep": ["sweep", "s.yaml", "--store", "S"],
    "sweep-dry-run": ["sweep", "s.yaml", "--store", "S", "--dry-run"],
    "report": ["report", "--store", "S", "--out", "rep"],
    "results": ["results", "export", "--store", "S"],
    "plan-calibrate": PLAN + ["--calibrate", "S"],
}


@pytest.mark.parametrize("fault", STORE_FAULTS)
@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_unusable_store_is_refused_before_anything_launches(no_launch, capsys, fault, command):
    make, reason = STORE_FAULTS[fault]
    _write_files(no_launch, {"t.yaml": {"workload": TINY}, "c.yaml": COMPARE, "s.yaml": SWEEP})
    store = str(no_launch / "store.sqlite")
    make(store)
    before = sorted(os.listdir(no_launch))
    line = one_line_error(capsys, cli_main([store if a == "S" else a for a in STORE_COMMANDS[command]]))
    assert line.startswith("error: store: ") and reason in line, line
    assert sorted(os.listdir(no_launch)) == before


def test_records_of_an_unknown_schema_version_are_left_out_with_a_warning(no_launch, capsys):
    store = ResultsStore("r.sqlite")
    store.write(_record("known"))
    future = {**_record("future"), "schema_version": 2}
    db = sqlite3.connect("r.sqlite")
    db.execute("INSERT INTO runs (run_id, schema_version, status, record_json) VALUES (?, 2, 'ok', ?)",
               ("future", json.dumps(future)))
    db.execute("INSERT INTO runs (run_id, schema_version, status, record_json) VALUES ('torn', 1, 'ok', '{not json')")
    db.commit()
    db.close()
    assert cli_main(["results", "export", "--store", "r.sqlite"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(x)["run_id"] for x in out.splitlines()] == ["known"]
    assert err.strip() == ("warning: store: left out 2 records this harness cannot read (1 with schema_version 2, "
                           "1 with unreadable; it reads schema_version 1)")
    with pytest.raises(StoreError, match="schema_version 2; this harness writes 1"):  # checked on write too
        ResultsStore("r.sqlite").write(future)
    assert ResultsStore("r.sqlite").fallback_records()["future"]["schema_version"] == 2
    assert "Traceback" not in err


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
    assert e.value.reason == (f"cannot write run r1 to {path} (database or disk is full); the record is saved in "
                              f"{path}.fallback.jsonl")
    assert store.get("r1")["status"] == "ok"  # the launcher still finds the runner's verdict
    heal()
    assert store.records() == [] and store.recover_fallback() == 1
    assert [r["run_id"] for r in store.records()] == ["r1"] and "fallback" not in store.get("r1")
    assert not any(os.path.exists(p) for p in fallback_paths(path))


def test_full_disk_stops_the_sweep_with_finished_points_intact_then_resumes(tmp_path, monkeypatch):
    """The sweep's part, with run_spec replaced by a stand-in that writes what a run writes; the
    disk fills after the first point (tests/test_faults_cli.py does it on a real full tmpfs)."""
    spec = parse_sweep({**SWEEP, "grid": {"workload.seed": [1, 2, 3]}})
    path = str(tmp_path / "r.sqlite")
    ran = []

    def run_spec(spec_dict, *, store_path, sweep, point_key, **kw):
        ran.append(point_key)
        rec = new_record(spec_dict, sweep=sweep, point_key=point_key)
        rec["status"] = "ok"
        ResultsStore(store_path).write(rec)
        return rec

    monkeypatch.setattr(launch, "run_spec", run_spec)
    heal = _failing_store(monkeypatch, after=1)
    with pytest.raises(StoreError, match="the record is saved in"):
        run_sweep(spec, launcher="direct", store_path=path, timeout_s=60, progress=False, echo=lambda *a: None)
    assert len(ran) == 2  # the third point never started
    assert [r["point_key"] for r in ResultsStore(path).records(sweep="s")] == ran[:1]
    heal()
    lines = []
    assert run_sweep(spec, launcher="direct", store_path=path, timeout_s=60, progress=False,
                     echo=lines.append)["ok"] == 1
    assert lines[0] == "merged 1 records that the store could not take earlier from its fallback file"
    keys = [r["point_key"] for r in ResultsStore(path).records(sweep="s")]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 3 and len(ran) == 3


# ---------------------------------------------------------------- 4. the first rank to fail

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
DEEPSPEED_TAIL = ("harness.launch: local rank 1 (pid 12) exited with code 137\n"
                  "harness.launch: local rank 0 (pid 11) exited with code 1\n"
                  "[launch.py:259:sigkill_handler] [...'--local_rank=1'...] exits with return code = 1\n")


def test_first_failure_from_the_launchers_output():
    echo = _failure(1, True, error="RuntimeError: Connection reset by peer")
    assert launch.first_failure(echo, TORCHRUN_TAIL) == {
        "rank": 0, "exit_code": -9, "how": "killed by SIGKILL (exit code -9)", "source": "torchrun"}
    got = launch.first_failure(_failure(0, True), DEEPSPEED_TAIL)
    assert (got["rank"], got["how"]) == (1, "exit code 137 (128 + SIGKILL)")
    assert launch.first_failure_line(got).startswith("rank 1 failed first: exit code 137 (128 + SIGKILL)")
    assert launch.first_failure(echo, "RuntimeError: boom") is None


# ---------------------------------------------------------------- 5. one sweep at a time

def test_second_instance_of_a_sweep_is_refused(no_launch, capsys):
    _write_files(no_launch, {"s.yaml": SWEEP})
    store = str(no_launch / "r.sqlite")
    with sweep_lock(parse_sweep(SWEEP), store) as lock:
        assert open(lock).read().strip() == str(os.getpid())
        line = one_line_error(capsys, cli_main(["sweep", "s.yaml", "--store", store]))
        assert line == f"error: sweep: s is already running on {store} (pid {os.getpid()})"
    assert not os.path.exists(lock)  # released and removed
    with sweep_lock(parse_sweep(SWEEP), store):  # free again
        pass


def test_spec_error_text_with_newlines_is_still_one_line(no_launch, capsys, monkeypatch):
    import harness.commands.env as env_cmd

    def boom(args):
        raise SpecError("x", "first\n  second\n")

    monkeypatch.setattr(env_cmd, "main", boom)
    assert one_line_error(capsys, cli_main(["env"])) == "error: x: first; second"
