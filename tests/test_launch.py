"""launch.py: commands per launcher, outcome classification, and no survivors after a run.

These tests use a tiny stand-in runner (written to tmp_path) so that they exercise the
process-tree handling without paying for a model; the sweep tests use the real runner.
"""

from __future__ import annotations

import os
import sys
import textwrap

import psutil
import pytest

from harness import launch
from harness.launch import supervise
from harness.store import ResultsStore

FAKE = textwrap.dedent('''
    """Stand-in for `harness train`: behaves as HARNESS_FAKE says, writes a record like the runner."""
    import os, sys, time, subprocess
    from harness.store import ResultsStore, new_record
    args = sys.argv[1:]
    store, run_id = args[args.index("--store") + 1], args[args.index("--run-id") + 1]
    sweep = args[args.index("--sweep") + 1] if "--sweep" in args else None
    key = args[args.index("--point-key") + 1] if "--point-key" in args else None
    mode = os.environ.get("HARNESS_FAKE", "ok")
    rank = int(os.environ.get("RANK", "0"))
    if mode == "hang-with-grandchild":
        # a grandchild in its own session, as torchrun does with its workers
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        time.sleep(600)
    if mode == "kill":
        os.kill(os.getpid(), 9)
    if mode == "note":
        print("note: building an op (stand-in)", flush=True)
        print("a line for the log only", flush=True)
    if mode == "oom-print":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(1)
    if mode == "ok-bad-exit":
        rec = new_record({"workload": {}, "layout": {}}, sweep=sweep, point_key=key)
        rec.update(run_id=run_id, status="ok", metrics={"tokens_per_s": 1.0})
        ResultsStore(store).write(rec)
        os.abort()
    if rank == 0:
        rec = new_record({"workload": {}, "layout": {}}, sweep=sweep, point_key=key)
        rec.update(run_id=run_id, status="ok", metrics={"tokens_per_s": 1.0})
        ResultsStore(store).write(rec)
''')


@pytest.fixture
def fake(tmp_path):
    (tmp_path / "fake_runner.py").write_text(FAKE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")])
    return tmp_path, {"PYTHONPATH": path}


def _run(tmp_path, env, mode, launcher="direct", nproc=1, timeout=60):
    return launch.run_spec(
        {"workload": {"device": "cpu"}, "layout": {}},
        nproc=nproc,
        launcher=launcher,
        store_path=str(tmp_path / "s.sqlite"),
        timeout_s=timeout,
        extra_env={**env, "HARNESS_FAKE": mode},
        log_dir=str(tmp_path / "logs"),
        module="fake_runner",
        sweep="t",
        point_key=mode,
    )


def test_a_runs_notes_reach_the_launching_console(fake, capsys):
    """What a rank says for the user while it runs (DeepSpeed building an op for minutes) is in its
    log, and on the console of the command that launched it; its other lines stay in the log."""
    tmp_path, env = fake
    rec = _run(tmp_path, env, "note")
    assert rec["status"] == "ok"
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: building an op (stand-in)"]
    assert "a line for the log only" in open(rec["launch"]["log"]).read()


def test_log_relay_echoes_whole_note_lines_once():
    """Lines are echoed when whole, once, without a launcher's rank prefix."""
    import tempfile

    from harness.launch.relay import LogRelay

    with tempfile.NamedTemporaryFile("wb", suffix=".log") as f:
        said = []
        relay = LogRelay(f.name, offset=0, echo=said.append)
        f.write(b"cmd line\n[rank0]: note: building X\nnote: bui")
        f.flush()
        relay.poll()
        assert said == ["note: building X"]
        f.write(b"lt X in 3 s\n0: notes are not this\n")
        f.flush()
        relay.poll()
        relay.poll()
        assert said == ["note: building X", "note: built X in 3 s"]


def test_build_command_variants():
    argv = ["train", "x.yaml"]
    tr = launch.build_command("torchrun", 2, argv, master_port=1234)
    assert tr[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=2" in tr
    assert "--master_port=1234" in tr and tr[-4:] == ["-m", "harness.cli", "train", "x.yaml"]
    ds = launch.build_command("deepspeed", 2, argv, master_port=1234)
    assert ds[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert ds[ds.index("--num_gpus") + 1] == "2" and ds[ds.index("--master_port") + 1] == "1234"
    assert ds[-4:] == ["--module", "harness.cli", "train", "x.yaml"]
    multi = launch.build_command("deepspeed", 8, argv, nnodes=2, node_rank=1, master_addr="n0")
    assert "--no_ssh" in multi and multi[multi.index("--node_rank") + 1] == "1"
    assert launch.build_command("direct", 1, argv)[1:] == ["-m", "harness.cli", "train", "x.yaml"]
    with pytest.raises(ValueError):
        launch.build_command("direct", 2, argv)
    with pytest.raises(ValueError):
        launch.build_command("mpirun", 2, argv)


def test_free_port_binds():
    import socket

    port = launch.free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # free: a launcher can take it
        s.bind(("127.0.0.1", port))


def test_classify_output():
    assert launch.classify_output("x\nCUDA out of memory. Tried", False) == "oom"
    assert launch.classify_output("torch.OutOfMemoryError: boom", False) == "oom"
    assert launch.classify_output("RuntimeError: x", False) == "failed"
    assert launch.classify_output("CUDA out of memory", True) == "timeout"


def test_ok_record_from_runner(fake):
    tmp_path, env = fake
    rec = _run(tmp_path, env, "ok")
    assert rec["status"] == "ok" and rec["metrics"]["tokens_per_s"] == 1.0
    assert rec["launch"]["exit_code"] == 0
    assert ResultsStore(str(tmp_path / "s.sqlite")).get(rec["run_id"])["launch"]["launcher"] == "direct"


def test_success_judged_from_record_not_exit_code(fake):
    tmp_path, env = fake
    rec = _run(tmp_path, env, "ok-bad-exit")
    assert rec["launch"]["exit_code"] != 0 and rec["status"] == "ok"


def test_killed_and_oom_without_record(fake):
    tmp_path, env = fake
    killed = _run(tmp_path, env, "kill")
    assert killed["status"] == "failed" and killed["launch"]["exit_code"] == -9
    oom = _run(tmp_path, env, "oom-print")
    assert oom["status"] == "oom" and "CUDA out of memory" in oom["error"]


def test_timeout_kills_grandchildren_in_other_sessions(fake):
    tmp_path, env = fake
    rec = _run(tmp_path, env, "hang-with-grandchild", timeout=3)
    assert rec["status"] == "timeout" and "timed out after 3" in rec["error"]
    assert launch.processes_with_env(launch.TOKEN_ENV, rec["run_id"]) == []


def test_torchrun_two_ranks(fake):
    tmp_path, env = fake
    rec = _run(tmp_path, env, "ok", launcher="torchrun", nproc=2)
    assert rec["status"] == "ok", rec.get("error")
    assert launch.processes_with_env(launch.TOKEN_ENV, rec["run_id"]) == []


def test_omp_threads_set_on_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = launch.run_env(2, {"workload": {"device": "cpu"}}, "tok", None)
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert env[launch.TOKEN_ENV] == "tok"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert launch.run_env(2, {"workload": {"device": "cpu"}}, "tok", None)["OMP_NUM_THREADS"] == "7"


def test_no_stray_processes_of_this_test_session():
    mine = [p for p in launch.processes_with_env(launch.TOKEN_ENV) if p.ppid() == os.getpid()]
    assert mine == []
    # multiprocessing's resource tracker (started by in-process spawn tests) lives as long as
    # pytest does by design; anything else still alive here was left behind.
    alive = [
        (c.pid, c.cmdline())
        for c in psutil.Process().children()
        if c.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in " ".join(c.cmdline())
    ]
    assert alive == []
    assert sys.executable


def test_record_written_then_hung_is_killed_after_grace(fake, monkeypatch):
    """A rank that wrote its failure record but never exits (peers stuck in a collective)."""
    tmp_path, env = fake
    monkeypatch.setattr(supervise, "LINGER_S", 2.0)
    (tmp_path / "fake_runner.py").write_text(
        FAKE.replace(
            'mode = os.environ.get("HARNESS_FAKE", "ok")',
            """mode = os.environ.get("HARNESS_FAKE", "ok")
if mode == "oom-then-hang":
    rec = new_record({"workload": {}, "layout": {}}, sweep=sweep, point_key=key)
    rec.update(run_id=run_id, status="oom", error="CUDA out of memory")
    ResultsStore(store).write(rec)
    time.sleep(600)""",
        )
    )
    rec = launch.run_spec(
        {"workload": {"device": "cpu"}, "layout": {}},
        nproc=1,
        launcher="direct",
        store_path=str(tmp_path / "s.sqlite"),
        timeout_s=120,
        extra_env={**env, "HARNESS_FAKE": "oom-then-hang"},
        log_dir=str(tmp_path / "logs"),
        module="fake_runner",
        sweep="t",
        point_key="x",
    )
    # ended by the grace after its record (LINGER_S), not by the run's timeout: an event, not a time
    assert rec["status"] == "oom" and "did not exit" in rec["error"] and not rec["launch"]["timed_out"]
    assert launch.processes_with_env(launch.TOKEN_ENV, rec["run_id"]) == []
