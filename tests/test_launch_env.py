"""What a launch gives each process: every run of a comparison the same threads per process (the
reference too; the user's OMP_NUM_THREADS wins), and under Slurm a per-job MASTER_PORT, and
--exclusive and --cpus-per-task in the batch script."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from harness import launch
from harness.errors import SpecError
from harness.store import ResultsStore
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload()


# ------------------------------------------------------------------ the same threads per process


def test_comparison_gives_every_run_the_same_threads_per_process(tmp_path, monkeypatch):
    from harness.compare.orchestrate import run_comparison
    from harness.compare.spec import parse_compare_spec
    from harness.report.compare import write_report

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    seen = {}

    def fake_run_spec(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir, extra_env=None):
        env = launch.run_env(nproc, spec, "tok", extra_env)
        seen[point_key] = (nproc, env.get("OMP_NUM_THREADS"))
        rec = {
            "run_id": "id-" + str(len(seen)),
            "status": "failed",
            "error": "x",
            "spec": spec,
            "sweep": sweep,
            "point_key": point_key,
        }
        ResultsStore(store_path).write(rec)
        return rec

    monkeypatch.setattr(launch, "run_spec", fake_run_spec)
    cs = parse_compare_spec(
        {"name": "t", "nproc": 2, "parity_steps": 2, "workload": dict(WORKLOAD), "runs": [{"engine": "own", "tp": 2}]}
    )
    summary = run_comparison(cs, store_path=str(tmp_path / "r.sqlite"), progress=False)
    assert {n for n, _ in seen.values()} == {1, 2}  # the single-device reference and a 2-process run
    assert {t for _, t in seen.values()} == {"4"}  # 8 cores // 2 processes, for the reference too
    assert summary["threads_per_process"] == 4
    md = open(write_report(summary, str(tmp_path / "rep"))["markdown"]).read()
    assert "Threads per process: 4" in md
    assert "Machine load average (1/5/15 min)" in md  # the load-average warning stays
    # the user's own OMP_NUM_THREADS wins, for every run alike
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    seen.clear()
    summary = run_comparison(cs, store_path=str(tmp_path / "r2.sqlite"), progress=False)
    assert {t for _, t in seen.values()} == {"3"} and summary["threads_per_process"] == 3


# ------------------------------------------------------------------ Slurm


def test_slurm_master_port_is_derived_from_the_job_and_array_task(monkeypatch):
    from harness import runtime

    base = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_ARRAY_JOB_ID": "4711",
        "SLURM_JOB_ID": "4712",
    }
    ports = set()
    for task in range(4):
        env = {**base, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_JOB_ID": str(4711 + task)}
        monkeypatch.setattr(os, "environ", env)
        runtime.adopt_slurm_env()
        port = int(os.environ["MASTER_PORT"])
        assert 1024 <= port < 32768
        ports.add(port)
    assert len(ports) == 4  # two array tasks on one node no longer collide
    # every rank of one task derives the same port; a set MASTER_PORT is kept
    assert runtime.slurm_master_port({**base, "SLURM_ARRAY_TASK_ID": "1"}) == runtime.slurm_master_port(
        {**base, "SLURM_ARRAY_TASK_ID": "1", "SLURM_PROCID": "1"}
    )
    assert runtime.slurm_master_port({"SLURM_JOB_ID": "1"}) != runtime.slurm_master_port({"SLURM_JOB_ID": "2"})
    monkeypatch.setattr(os, "environ", {**base, "MASTER_PORT": "12345"})
    runtime.adopt_slurm_env()
    assert os.environ["MASTER_PORT"] == "12345"


@pytest.mark.slow  # bash -n checks the script
def test_slurm_script_exclusive_and_cpus_per_task(tmp_path):
    from harness.sweep.expand import expand
    from harness.sweep.slurm import write_slurm
    from harness.sweep.spec import parse_sweep

    raw = {
        "name": "big",
        "gpus": 2,
        "workload": dict(WORKLOAD),
        "layout": {"engine": "own"},
        "grid": {"tp": [1, 2]},
        "slurm": {"exclusive": True, "cpus_per_task": 6, "partition": "cpu"},
    }
    sweep = parse_sweep(raw)
    points, _ = expand(sweep)
    script = open(write_slurm(sweep, points, str(tmp_path / "job"), timeout_s=60)).read()
    assert "#SBATCH --exclusive\n" in script and "#SBATCH --cpus-per-task=6\n" in script
    assert "srun --kill-on-bad-exit=1 --ntasks-per-node=2 --cpus-per-task=6 " in script
    bash = shutil.which("bash")
    assert subprocess.run([bash, "-n", str(tmp_path / "job" / "sweep.sbatch")]).returncode == 0
    plain = open(write_slurm(parse_sweep({**raw, "slurm": {}}), points, str(tmp_path / "job2"), timeout_s=60)).read()
    assert "--exclusive" not in plain and "--cpus-per-task" not in plain

    for bad, field in (
        ({"exclusive": "yes"}, "sweep.slurm.exclusive"),
        ({"cpus_per_task": 0}, "sweep.slurm.cpus_per_task"),
        ({"cpus-per-task": 4}, "sweep.slurm.cpus-per-task"),
    ):
        with pytest.raises(SpecError) as e:
            parse_sweep({**raw, "slurm": bad})
        assert e.value.field == field


# ------------------------------------------------------------------ a DeepSpeed op's build, said


def test_a_deepspeed_op_build_is_said_before_and_after(tmp_path, monkeypatch, capsys):
    """The first local rank says that DeepSpeed's op is being built, where, and how long it took;
    a load of the built op says nothing; another local rank says nothing (the op's builder stands in
    for DeepSpeed's: its library appears during the block, as torch's load() writes it)."""
    from types import SimpleNamespace

    from harness.frameworks.deepspeed import extensions

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(extensions, "jit_op", lambda: "deepspeed_shm_comm")
    library = tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    with extensions.announce_build(SimpleNamespace(local_rank=0)):
        library.parent.mkdir(exist_ok=True)
        library.write_bytes(b"")
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 2
    assert said[0].startswith(f"note: building DeepSpeed's deepspeed_shm_comm op in {library.parent} ")
    assert said[1].startswith("note: built DeepSpeed's deepspeed_shm_comm op in ")
    for rank in (0, 1):  # built: a load is silent; a second local rank is silent
        with extensions.announce_build(SimpleNamespace(local_rank=rank)):
            pass
    assert capsys.readouterr().out == ""


def test_deepspeed_shm_workspaces_of_one_run_are_found_and_removed(tmp_path):
    """DeepSpeed's CPU allreduce names a workspace per rank by uid, master address, port and rank and never
    unlinks it: a run's own are removed (one rank's, or all of a port's), another run's are left."""
    from harness.runtime import deepspeed_shm_buffers, remove_deepspeed_shm_buffers

    uid = os.getuid()
    for port, rank in [(5000, 0), (5000, 1), (5001, 0)]:
        (tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_{port}_{rank}").write_bytes(b"x")
    assert len(deepspeed_shm_buffers("127.0.0.1", 5000, shm_dir=str(tmp_path))) == 2
    assert remove_deepspeed_shm_buffers("127.0.0.1", 5000, 1, shm_dir=str(tmp_path)) == 1
    assert remove_deepspeed_shm_buffers("127.0.0.1", 5000, shm_dir=str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_5001_0"]
