"""A command given bad input (its arguments, the spec or data files they name, a store it cannot
use) says one line `error: <field>: ...`, exits with code 2 and launches and writes nothing;
records of a schema this harness does not read are left out with a warning.

These call harness.cli.main in-process (the code path of `python -m harness.cli`, without paying
for a Python start per case); a process start fails a quick test (tests/conftest.py). The slow
tests at the end run a representative subset through the real CLI. What a spec says is checked
field by field in tests/test_spec_errors.py, token data in tests/test_data_errors.py, and what
fails while a run or sweep runs in tests/test_run_faults.py.
"""

from __future__ import annotations

import json
import os
import sqlite3

import pytest
import yaml

from harness.cli import main as cli_main
from harness.errors import SpecError, StoreError
from harness.store import ResultsStore, new_record

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
COMPARE = {"name": "c", "workload": {**TINY, "steps": 5}, "runs": [{"engine": "own", "dp": 2}]}
SWEEP = {"name": "s", "gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2]}}
PLAN = ["plan", "--model", "tiny", "--seq-len", "128", "--global-batch-size", "8", "--gpus", "8"]
BIG = {"workload": {**TINY, "seq_len": 10**12}}

# (id, argv, files to write, the line's start, a part of the reason)
BAD_INPUTS = [
    # a sweep that would run nothing
    (
        "sweep-all-dropped-unknown-model",
        ["sweep", "s.yaml"],
        {"s.yaml": {**SWEEP, "workload": {**TINY, "model": "x"}}},
        "error: sweep: all 2 points were dropped (first: workload.model: unknown preset 'x'",
        "; see --dry-run",
    ),
    (
        "sweep-all-dropped-typo",
        ["sweep", "s.yaml"],
        {"s.yaml": {**SWEEP, "workload": {**TINY, "seqlen": 8}}},
        "error: sweep: all 2 points were dropped (first: workload.seqlen: unknown key",
        "see --dry-run",
    ),
    # arguments, spec values and input files out of range
    (
        "compare-timeout-negative",
        ["compare", "c.yaml", "--timeout", "-1"],
        {"c.yaml": COMPARE},
        "error: --timeout: ",
        "must be a positive number",
    ),
    (
        "compare-timeout-zero",
        ["compare", "c.yaml", "--timeout", "0"],
        {"c.yaml": COMPARE},
        "error: --timeout: ",
        "positive",
    ),
    (
        "compare-timeout-nan",
        ["compare", "c.yaml", "--timeout", "nan"],
        {"c.yaml": COMPARE},
        "error: --timeout: ",
        "positive",
    ),
    ("sweep-timeout-zero", ["sweep", "s.yaml", "--timeout", "0"], {"s.yaml": SWEEP}, "error: --timeout: ", "positive"),
    ("compare-store-int", ["compare", "c.yaml"], {"c.yaml": {**COMPARE, "store": 123}}, "error: store: ", "file path"),
    ("sweep-store-int", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "store": 123}}, "error: sweep.store: ", "file path"),
    (
        "compare-reference-string",
        ["compare", "c.yaml"],
        {"c.yaml": {**COMPARE, "reference": "no"}},
        "error: reference: ",
        "must be true or false",
    ),
    (
        "sweep-point-timeout-word",
        ["sweep", "s.yaml", "--dry-run"],
        {"s.yaml": {**SWEEP, "points": [{"workload.seed": 3, "timeout_s": "fast"}]}},
        "error: sweep.points[0].timeout_s: ",
        "positive number",
    ),
    (
        "sweep-name-escapes",
        ["sweep", "s.yaml", "--dry-run"],
        {"s.yaml": {**SWEEP, "name": "../../x"}},
        "error: sweep.name: ",
        "no '/'",
    ),
    ("sweep-name-slash", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "name": "a/b"}}, "error: sweep.name: ", "no '/'"),
    ("sweep-name-dotdot", ["sweep", "s.yaml"], {"s.yaml": {**SWEEP, "name": ".."}}, "error: sweep.name: ", "'..'"),
    (
        "sweep-name-too-long",
        ["sweep", "s.yaml"],
        {"s.yaml": {**SWEEP, "name": "x" * 300}},
        "error: sweep.name: ",
        "300 bytes",
    ),
    (
        "compare-name-too-long",
        ["compare", "c.yaml"],
        {"c.yaml": {**COMPARE, "name": "x" * 250}},
        "error: name: ",
        "bytes",
    ),
    (
        "train-seq-len-1e12-int",
        ["train", "t.yaml"],
        {"t.yaml": BIG},
        "error: workload.seq_len: needs about ",
        "PiB per device",
    ),
    (
        "compare-seq-len-1e12",
        ["compare", "c.yaml"],
        {"c.yaml": {**COMPARE, "workload": {**TINY, "seq_len": 10**12}}},
        "error: workload.seq_len: needs about ",
        "PiB",
    ),
    (
        "export-out-missing-folder",
        ["results", "export", "--store", "r.sqlite", "--out", "nope/x.jsonl"],
        {"r.sqlite": None},
        "error: --out: ",
        "does not exist",
    ),
    (
        "export-out-is-folder",
        ["results", "export", "--store", "r.sqlite", "--out", "."],
        {"r.sqlite": None},
        "error: --out: ",
        "is a folder",
    ),
    (
        "report-out-is-file",
        ["report", "--store", "r.sqlite", "--out", "t.yaml"],
        {"r.sqlite": None, "t.yaml": "x: 1\n"},
        "error: --out: ",
        "is a file",
    ),
    (
        "report-out-missing-parent",
        ["report", "--store", "r.sqlite", "--out", "no/such/dir"],
        {"r.sqlite": None},
        "error: --out: ",
        "does not exist",
    ),
    (
        "compare-out-is-file",
        ["compare", "c.yaml", "--out", "c.yaml"],
        {"c.yaml": COMPARE},
        "error: --out: ",
        "is a file",
    ),
    (
        "data-prepare-out-missing-folder",
        ["data", "prepare", "t.txt", "--out", "no/x.bin"],
        {"t.txt": "hello"},
        "error: --out: ",
        "does not exist",
    ),
    (
        "train-peak-negative",
        ["train", "t.yaml", "--peak-tflops", "-5"],
        {"t.yaml": {"workload": TINY}},
        "error: --peak-tflops: ",
        "positive",
    ),
    ("plan-gpus-per-node-zero", PLAN + ["--gpus-per-node", "0"], {}, "error: --gpus-per-node: ", "at least 1"),
    (
        "report-timeline-unknown-run",
        ["report", "--store", "r.sqlite", "--out", "rep", "--timeline-run", "zzz"],
        {"r.sqlite": None},
        "error: --timeline-run: ",
        "'zzz' is the start of no run ids",
    ),
    (
        "report-timeline-ambiguous",
        ["report", "--store", "r.sqlite", "--out", "rep", "--timeline-run", "run-"],
        {"r.sqlite": None},
        "error: --timeline-run: ",
        "2 run ids",
    ),
    ("train-empty-spec", ["train", "e.yaml"], {"e.yaml": ""}, "error: e.yaml: ", "is empty"),
    ("compare-empty-spec", ["compare", "e.yaml"], {"e.yaml": "# only a comment\n"}, "error: e.yaml: ", "is empty"),
    ("sweep-empty-spec", ["sweep", "e.yaml"], {"e.yaml": "\n"}, "error: e.yaml: ", "is empty"),
    (
        "plan-hardware-yaml-malformed",
        PLAN + ["--hardware", "hw.yaml"],
        {"hw.yaml": "name: x\nmemory_gib: [1, 2\npeak: 3\n"},
        "error: --hardware: hw.yaml: not valid YAML: line 3, column 5: ",
        "expected ','",
    ),
    (
        "plan-hardware-key-twice",
        PLAN + ["--hardware", "hw.yaml"],
        {"hw.yaml": "name: x\nmemory_gib: 80\nmemory_gib: 40\n"},
        "error: --hardware: hw.yaml: ",
        "key 'memory_gib' is given twice",
    ),
    (
        "plan-hardware-not-finite",
        PLAN + ["--hardware", "hw.yaml"],
        {
            "hw.yaml": "name: x\npeak_tflops_bf16: .nan\nmemory_gib: 80\nhbm_gbps: 1\nnvlink_gbps: 1\n"
            "internode_gbps: 1\ngpus_per_node: 8\n"
        },
        "error: --hardware: hw.yaml: ",
        "peak_tflops_bf16 must be a positive number",
    ),
    # token data that does not fit the workload
    (
        "data-dtype-differs-from-prepare",
        ["train", "t.yaml"],
        {
            "t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin", "dtype": "uint32"}}},
            "d.bin": b"\x01\x00" * 4096,
            "d.bin.json": {"tokens": 4096, "dtype": "uint16", "vocab_size": 256},
        },
        "error: workload.data.dtype: ",
        "says the file holds uint16 tokens",
    ),
    (
        "data-odd-bytes-uint16",
        ["train", "t.yaml"],
        {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01" * 4097},
        "error: workload.data.path: ",
        "4097 bytes, not a whole number of uint16 tokens",
    ),
    (
        "data-shorter-than-a-batch",
        ["train", "t.yaml"],
        {"t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01\x00" * 100},
        "error: workload.data.path: ",
        "holds 100 tokens, fewer than one global batch of 4 x (seq_len 32 + 1) = 132",
    ),
    (
        "data-vocab-larger-than-model",
        ["train", "t.yaml"],
        {
            "t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}},
            "d.bin": b"\x01\x00" * 4096,
            "d.bin.json": {"tokens": 4096, "dtype": "uint16", "vocab_size": 32000},
        },
        "error: workload.data.path: ",
        "vocabulary of 32000",
    ),
    (
        "sweep-data-all-dropped",
        ["sweep", "s.yaml"],
        {"s.yaml": {**SWEEP, "workload": {**TINY, "data": {"kind": "file", "path": "d.bin"}}}, "d.bin": b"\x01" * 11},
        "error: sweep: all 2 points were dropped (first: workload.data.path: ",
        "11 bytes",
    ),
    # mistakes that used to launch, or to blame another field, refused before anything starts
    (
        "train-deepspeed-without-launcher",  # was a 26-line traceback, exit 1 and a failed record
        ["train", "t.yaml"],
        {"t.yaml": {"workload": TINY, "layout": {"engine": "deepspeed", "zero_stage": 1}}},
        "error: layout.engine: engine deepspeed needs a process group",
        "torchrun --nproc-per-node 1 -m harness.cli train",
    ),
    (
        "memory-deepspeed",  # blamed layout.zero_stage
        ["memory", "t.yaml"],
        {"t.yaml": {"workload": TINY, "layout": {"engine": "deepspeed"}}},
        "error: layout.engine: harness memory traces engines own and fsdp; ",
        "DeepSpeed's initialize is not traceable",
    ),
    (
        "memory-deepspeed-set",
        ["memory", "t.yaml", "--set", "layout.engine=deepspeed"],
        {"t.yaml": {"workload": TINY}},
        "error: --set: layout.engine=deepspeed: harness memory traces engines own and fsdp; ",
        "(set engine: own or fsdp)",
    ),
    (
        "plan-seq-len-beyond-positions",  # did not say how to raise them
        [*PLAN[:3], "--seq-len", "4096", *PLAN[5:]],
        {},
        "error: --seq-len: 4096 is beyond the 2048 positions of tiny",
        "; --max-positions 4096 raises it",
    ),
    (
        "sweep-grid-value-invalid-everywhere",  # ran the rest, exit 0
        ["sweep", "s.yaml"],
        {"s.yaml": {**SWEEP, "grid": {"attention": ["sdpa", "flash"]}}},
        "error: sweep.grid.attention: flash is invalid in every point it is part of (1; first: layout.attention: ",
        "remove it from the grid",
    ),
    (
        "sweep-grid-tp3-on-2-gpus",
        ["sweep", "s.yaml", "--dry-run"],
        {"s.yaml": {**SWEEP, "gpus": 2, "layout": {"engine": "own"}, "grid": {"parallel": [{"tp": 1}, {"tp": 3}]}}},
        "error: sweep.grid.parallel[1]: tp=3 is invalid in every point it is part of (1; first: layout: 2 GPUs ",
        "remove it from the grid",
    ),
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
BAD_INPUTS += [
    (f"train-{name}", ["train", "t.yaml"], {"t.yaml": text + "\n"}, "error: " + start, reason)
    for name, (text, start, reason) in TRAIN_YAML.items()
]


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
            path.write_text(
                content
                if isinstance(content, str)
                else (json.dumps(content) if name.endswith(".json") else yaml.safe_dump(content))
            )


def _record(run_id: str, status: str = "ok", **kw) -> dict:
    rec = new_record({"workload": {"model": "tiny"}, "layout": {"engine": "single"}}, **kw)
    rec.update(run_id=run_id, status=status, metrics={"tokens_per_s": 1.0})
    return rec


@pytest.mark.parametrize("argv, files, start, reason", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_nothing_launches(no_launch, one_line_error, argv, files, start, reason):
    _write_files(no_launch, files)
    before = sorted(os.listdir(no_launch))
    line = one_line_error(cli_main(list(argv)))
    assert line.startswith(start) and reason in line, line
    assert sorted(os.listdir(no_launch)) == before  # no store, no logs, no report: nothing was written


def test_partly_dropped_sweep_says_how_many_and_why_before_it_runs(no_launch, capsys, monkeypatch):
    import harness.commands.sweep as sweep_cmd

    ran = []
    monkeypatch.setattr(sweep_cmd, "run_sweep", lambda spec, **kw: ran.append(spec.name) or {"ok": 2})
    _write_files(
        no_launch,
        {
            "s.yaml": {
                **SWEEP,  # micro-batch 4 runs with 4 sequences, not with 2 or 6: dropped, not refused
                "grid": {"micro_batch_size": [1, 2, 4], "workload.global_batch_size": [4, 2, 6]},
                "exclude": [{"micro_batch_size": 2}],
            }
        },
    )
    assert cli_main(["sweep", "s.yaml"]) == 0 and ran == ["s"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "note: sweep: 3 of 9 points dropped: excluded by exclude[0] {'micro_batch_size': 2} (and 2 more like it); "
        "see --dry-run",
        "note: sweep: 2 of 9 points dropped: workload.global_batch_size: 2 is not divisible by dp x "
        "micro_batch_size = 1 x 4 (and 1 more like it); see --dry-run",
    ]


# ---------------------------------------------------------------- stores this harness cannot use


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
def test_unusable_store_is_refused_before_anything_launches(no_launch, one_line_error, fault, command):
    make, reason = STORE_FAULTS[fault]
    _write_files(no_launch, {"t.yaml": {"workload": TINY}, "c.yaml": COMPARE, "s.yaml": SWEEP})
    store = str(no_launch / "store.sqlite")
    make(store)
    before = sorted(os.listdir(no_launch))
    line = one_line_error(cli_main([store if a == "S" else a for a in STORE_COMMANDS[command]]))
    assert line.startswith("error: store: ") and reason in line, line
    assert sorted(os.listdir(no_launch)) == before


def test_records_of_an_unknown_schema_version_are_left_out_with_a_warning(no_launch, capsys):
    store = ResultsStore("r.sqlite")
    store.write(_record("known"))
    future = {**_record("future"), "schema_version": 2}
    db = sqlite3.connect("r.sqlite")
    db.execute(
        "INSERT INTO runs (run_id, schema_version, status, record_json) VALUES (?, 2, 'ok', ?)",
        ("future", json.dumps(future)),
    )
    db.execute("INSERT INTO runs (run_id, schema_version, status, record_json) VALUES ('torn', 1, 'ok', '{not json')")
    db.commit()
    db.close()
    assert cli_main(["results", "export", "--store", "r.sqlite"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(x)["run_id"] for x in out.splitlines()] == ["known"]
    assert err.strip() == (
        "warning: store: left out 2 records this harness cannot read (1 with schema_version 2, "
        "1 with unreadable; it reads schema_version 1)"
    )
    with pytest.raises(StoreError, match="schema_version 2; this harness writes 1"):  # checked on write too
        ResultsStore("r.sqlite").write(future)
    assert ResultsStore("r.sqlite").fallback_records()["future"]["schema_version"] == 2
    assert "Traceback" not in err


def test_spec_error_text_with_newlines_is_still_one_line(no_launch, one_line_error, monkeypatch):
    import harness.commands.env as env_cmd

    def boom(args):
        raise SpecError("x", "first\n  second\n")

    monkeypatch.setattr(env_cmd, "main", boom)
    assert one_line_error(cli_main(["env"])) == "error: x: first; second"


# ---------------------------------------------------------------- through the real CLI (slow tier)
# A representative subset of the cases above, and a store of a newer schema, as a user meets them:
# after the refusal no process carrying the `tagged` CLI's tag exists (nothing launched).


def assert_one_line_error(r, start: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


CASES = [  # (id, files, argv, line start)
    (
        "sweep-all-dropped",
        {"s.yaml": {"gpus": 1, "workload": {**TINY, "model": "llama-7000b"}, "grid": {"workload.seed": [1, 2]}}},
        ["sweep", "s.yaml"],
        "error: sweep: all 2 points were dropped (first: workload.model: unknown preset",
    ),
    (
        "compare-timeout-negative",
        {"c.yaml": {"workload": {**TINY, "steps": 5}, "runs": [{"engine": "own", "dp": 2}]}},
        ["compare", "c.yaml", "--timeout", "-1"],
        "error: --timeout: must be a positive number",
    ),
    (
        "sweep-store-int",
        {"s.yaml": {"gpus": 1, "workload": TINY, "store": 123}},
        ["sweep", "s.yaml"],
        "error: sweep.store: must be a file path",
    ),
    (
        "sweep-name-escapes",
        {"s.yaml": {"gpus": 1, "workload": TINY, "name": "../../x"}},
        ["sweep", "s.yaml"],
        "error: sweep.name: '../../x'",
    ),
    (
        "train-seq-len-1e12",
        {"t.yaml": "workload: {seq_len: 1e12, device: cpu}\n"},
        ["train", "t.yaml"],
        "error: workload.seq_len: needs about ",
    ),
    ("train-empty-spec", {"t.yaml": ""}, ["train", "t.yaml"], "error: t.yaml: is empty"),
    (
        "train-wrong-dtype",
        {
            "t.yaml": {"workload": {**TINY, "data": {"kind": "file", "path": "d.bin", "dtype": "uint32"}}},
            "d.bin": "ab" * 4096,
            "d.bin.json": '{"dtype": "uint16", "vocab_size": 256}',
        },
        ["train", "t.yaml"],
        "error: workload.data.dtype: uint32, but d.bin.json",
    ),
    (
        "plan-hardware-yaml",
        {"hw.yaml": "name: x\nmemory_gib: [1, 2\npeak: 3\n"},
        [*"plan --model tiny --seq-len 128 --global-batch-size 8 --gpus 8 --hardware hw.yaml".split()],
        "error: --hardware: hw.yaml: not valid YAML: line 3, column 5",
    ),
    (
        "train-store-not-sqlite",
        {"t.yaml": {"workload": TINY}, "r.sqlite": "a,b\n" * 100},
        ["train", "t.yaml", "--store", "r.sqlite"],
        "error: store: r.sqlite is not a readable results store",
    ),
    (
        "sweep-store-directory",
        {"s.yaml": {"gpus": 1, "workload": TINY}},
        ["sweep", "s.yaml", "--store", "."],
        "error: store: . is a directory",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("files, argv, start", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_through_the_cli(tmp_path, tagged, files, argv, start):
    _write_files(tmp_path, files)
    before = sorted(os.listdir(tmp_path))
    assert_one_line_error(tagged(*argv), start)
    assert sorted(os.listdir(tmp_path)) == before and tagged.alive() == []


@pytest.mark.slow
def test_store_of_a_newer_schema_is_refused_before_a_run_and_unknown_records_are_left_out(tmp_path, tagged):
    store = str(tmp_path / "r.sqlite")
    ResultsStore(store).write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "old"})
    db = sqlite3.connect(store)
    db.execute(
        "INSERT INTO runs (run_id, schema_version, status, record_json) VALUES ('new', 3, 'ok', "
        '\'{"run_id": "new", "schema_version": 3, "status": "ok"}\')'
    )
    db.commit()
    r = tagged("results", "export", "--store", store)
    assert r.returncode == 0 and [json.loads(ln)["run_id"] for ln in r.stdout.splitlines()] == ["old"], r.stderr
    assert r.stderr.strip() == (
        "warning: store: left out 1 records this harness cannot read (1 with schema_version 3; "
        "it reads schema_version 1)"
    )
    db.execute("ALTER TABLE runs ADD COLUMN energy_j REAL")  # a newer harness's store
    db.commit()
    db.close()
    _write_files(tmp_path, {"t.yaml": {"workload": TINY}})
    line = assert_one_line_error(tagged("train", "t.yaml", "--store", store), "error: store: ")
    assert "energy_j" in line and tagged.alive() == []
    assert sqlite3.connect(store).execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 2  # nothing written
