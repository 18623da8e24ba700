"""The bad inputs that once escaped as tracebacks, silent acceptance or a hang (a held-out probe of bad inputs):
each is one line `error: ...` and exit 2 before anything starts and nothing is left behind, or, for a fault
after the work (a full disk), its own exit code (74) and a message that says where the record waits and
that the next command opening the store merges it in.

In-process through harness.cli.main, as tests/test_cli_errors.py does; the import parsers' own cases
(binary files, shell quoting, ds_config types) are in the interop tests.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

import pytest
import yaml

from harness.cli import EX_IOERR
from harness.cli import main as cli_main
from harness.store import ResultsStore, new_record
from harness.store import database as store_db

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
PLAN = ["plan", "--seq-len", "128", "--global-batch-size", "8", "--gpus", "8", "--hardware", "h100-sxm"]

HUGE = json.dumps({**SIZES, "vocab_size": 256}).replace('"hidden_size": 64', '"hidden_size": 1' + "0" * 400)
# (id, config.json text, a part of the reason)
CONFIGS = [
    ("model-type-list", json.dumps({**SIZES, "vocab_size": 256, "model_type": ["mixtral"]}), "model_type must be a"),
    ("rope-parameters-word", json.dumps({**SIZES, "vocab_size": 256, "rope_parameters": "default"}), "a mapping"),
    ("rope-parameters-list", json.dumps({**SIZES, "vocab_size": 256, "rope_parameters": [1, 2]}), "a mapping"),
    ("hidden-401-digits", HUGE, "hidden_size must be below"),
    (
        "experts-401-digits",
        json.dumps({**SIZES, "vocab_size": 256, "model_type": "mixtral", "num_local_experts": 10**400}),
        "num_local_experts must be below",
    ),
]


@pytest.mark.parametrize("text, reason", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_malformed_config_json_is_one_line(no_launch, one_line_error, text, reason):
    (no_launch / "config.json").write_text(text)
    line = one_line_error(cli_main([*PLAN, "--model", "config.json"]))
    assert line.startswith("error: --model: ") and reason in line, line


def _compare(runs: list, workload: dict | None = None) -> dict:
    return {"name": "c", "workload": workload or {**TINY, "steps": 5}, "runs": runs}


SPECS = [
    (
        "moe-ffn-97-tp2",
        _compare(
            [{"engine": "own", "tp": 2}], {**TINY, "steps": 5, "model": "tiny-moe", "model_overrides": {"moe_ffn": 97}}
        ),
        "error: runs[0].tp: expert width moe_ffn 97 is not divisible by tp=2",
    ),
    (
        "label-of-the-reference",
        _compare([{"engine": "own", "dp": 2, "label": "reference (single device)"}]),
        "error: runs[0].label: 'reference (single device)' is the label of the run the harness adds",
    ),
    (
        "label-a-list",
        _compare([{"engine": "own", "dp": 2, "label": ["own", "dp2"]}]),
        "error: runs[0].label: must be a non-empty string, got ['own', 'dp2']",
    ),
]


@pytest.mark.parametrize("spec, start", [c[1:] for c in SPECS], ids=[c[0] for c in SPECS])
def test_compare_spec_mistakes_once_accepted_are_one_line(no_launch, one_line_error, spec, start):
    (no_launch / "c.yaml").write_text(yaml.safe_dump(spec))
    before = sorted(os.listdir(no_launch))
    line = one_line_error(cli_main(["compare", "c.yaml"]))
    assert line.startswith(start), line
    assert sorted(os.listdir(no_launch)) == before


def test_memory_of_moe_ffn_not_divisible_by_tp_is_refused(no_launch, one_line_error):
    """`harness memory` once crashed on the shape mismatch the spec check let through."""
    spec = {"workload": {**TINY, "model": "tiny-moe", "model_overrides": {"moe_ffn": 97}}, "layout": {"tp": 2}}
    (no_launch / "t.yaml").write_text(yaml.safe_dump({**spec, "layout": {"engine": "own", "tp": 2}}))
    line = one_line_error(cli_main(["memory", "t.yaml"]))
    assert "moe_ffn 97 is not divisible by tp=2" in line, line


def _special_paths(tmp_path) -> dict:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return {"fifo": str(fifo), "device": os.devnull}


@pytest.mark.parametrize("kind", ["fifo", "device"])
@pytest.mark.parametrize("command", [["results", "export"], ["report", "--out", "r"]])
def test_a_store_that_is_no_regular_file_is_refused_without_waiting(no_launch, one_line_error, kind, command):
    """A FIFO once hung every command; /dev/null left /dev/null-journal behind."""
    path = _special_paths(no_launch)[kind]
    journal = path + "-journal"
    existed = os.path.exists(journal)
    line = one_line_error(cli_main([*command, "--store", path]))
    assert line == f"error: store: {path} is not a regular file (a device, pipe or socket); give a file path"
    assert os.path.exists(journal) == existed


@pytest.mark.parametrize("command", [["import", "megatron", "m.sh", "--out", "/dev/full"]])
def test_an_output_that_is_a_device_is_refused_before_the_work(no_launch, one_line_error, command):
    (no_launch / "m.sh").write_text("torchrun pretrain_gpt.py --num-layers 2\n")
    line = one_line_error(cli_main(command))
    assert line.startswith("error: --out: /dev/full is not a regular file"), line


def test_a_busy_store_is_called_busy(no_launch, one_line_error, monkeypatch):
    """A store another process holds locked is busy, not 'not a readable results store'."""
    path = str(no_launch / "r.sqlite")
    ResultsStore(path).write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "r1"})
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_S", 0.2)
    holder = sqlite3.connect(path)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        line = one_line_error(cli_main(["results", "export", "--store", path]))
    finally:
        holder.rollback()
        holder.close()
    assert line == (
        f"error: store: {path} is busy: another process holds a lock on it and did not let go within 0.2 s; "
        "try again when that process finishes"
    )


def _full_disk(monkeypatch):
    real = ResultsStore._insert

    def insert(self, record, keep):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(ResultsStore, "_insert", insert)
    return lambda: monkeypatch.setattr(ResultsStore, "_insert", real)


def test_a_record_written_on_a_full_disk_is_a_fault_and_every_command_merges_it_back(no_launch, capsys, monkeypatch):
    """The compare that hit a full disk once exited 2 (a mistake in the input) and only `harness sweep`
    merged its record back."""
    from harness.errors import StoreWriteError

    path = str(no_launch / "r.sqlite")
    store = ResultsStore(path)
    heal = _full_disk(monkeypatch)
    with pytest.raises(StoreWriteError, match="the next harness command that opens this store merges it in"):
        store.write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "r1"})
    heal()
    assert cli_main(["results", "export", "--store", path]) == 0
    out, err = capsys.readouterr()
    assert '"r1"' in out and f"store: merged 1 records that an earlier command could not write into {path}" in err
    assert not any(os.path.exists(p) for p in store_db.fallback_paths(path))


def test_a_store_write_fault_exits_74_with_one_line(no_launch, capsys, monkeypatch):
    from harness.commands import results
    from harness.errors import StoreWriteError

    def fails(args):
        raise StoreWriteError("cannot write run r1 to r.sqlite (database or disk is full); the record is saved in x")

    monkeypatch.setattr(results, "main", fails)
    assert cli_main(["results", "export"]) == EX_IOERR == 74
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: store: cannot write run r1 to r.sqlite (database or disk is full); the record is saved in x"
    ]


def test_stdout_on_a_full_disk_is_one_line_and_exit_74(no_launch, capfd, monkeypatch):
    """`harness plan ... > /dev/full` once ended in an OSError traceback."""
    import sys

    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", full)
        rc = cli_main(["plan", "--model", "tiny", "--seq-len", "128", "--global-batch-size", "8", "--gpus", "8"])
        monkeypatch.undo()
    err = capfd.readouterr().err.strip().splitlines()
    assert rc == EX_IOERR and err == ["error: stdout: No space left on device: the output was not written whole"]


def test_a_busy_lock_on_another_thread_is_waited_for_not_refused(no_launch, monkeypatch):
    """The busy message is for a lock that outlives the wait, not for one let go within it."""
    path = str(no_launch / "r.sqlite")
    ResultsStore(path).write({**new_record({"workload": {}, "layout": {}}), "status": "ok", "run_id": "r1"})
    monkeypatch.setattr(store_db, "BUSY_TIMEOUT_S", 30.0)
    holder = sqlite3.connect(path, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    threading.Timer(0.3, holder.rollback).start()
    assert [r["run_id"] for r in ResultsStore(path).records()] == ["r1"]
    holder.close()
