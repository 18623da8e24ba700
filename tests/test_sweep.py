"""Sweeps: expansion with reasons, faults that must not stop a sweep, SIGKILL and resume, Slurm.

The run tests use the real `harness train` on the tiny model (one process per point, the
single-device engine, under torchrun so that ranks live in sessions of their own, as on a
cluster) with the runner's test-only fault hook HARNESS_FAULT.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml
from conftest import run_cli, start_cli

from harness import launch
from harness.cli import main as cli_main
from harness.errors import SpecError
from harness.launch import supervise
from harness.parallel_dims import ParallelDims
from harness.store import ResultsStore
from harness.sweep.execute import run_sweep, sweep_id
from harness.sweep.expand import check_grid_values, expand
from harness.sweep.slurm import collect, write_slurm
from harness.sweep.spec import load_sweep, parse_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 3, "warmup_steps": 1, "device": "cpu"}


def tiny_sweep(name: str, gpus: int, engine: str, **fields) -> dict:
    """A sweep of TINY under one engine; fields adds the rest (timeout_s, grid, points)."""
    return {"name": name, "gpus": gpus, "workload": TINY, "layout": {"engine": engine}, **fields}


def fault_point(seed: int, fault: str, **fields) -> dict:
    """A point with its own seed that the runner's fault hook HARNESS_FAULT makes fail."""
    return {"workload.seed": seed, "env": {"HARNESS_FAULT": fault}, **fields}


def _write(tmp_path, raw, name="s.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_expand_grid_filters_and_reasons():
    spec = parse_sweep(
        {
            "name": "g",
            "gpus": 2,
            "workload": TINY,
            "layout": {"engine": "own"},
            "grid": {
                "tp": [1, 2, 3],
                "pp": [1, 2],
                "micro_batch_size": [1, 2, 4],
                "kernel": [{"attention": "naive", "rmsnorm": "torch"}, {"attention": "sdpa"}],
            },
            "exclude": [{"tp": 2, "pp": 2}, {"attention": "sdpa", "micro_batch_size": 1}],
        }
    )
    points, drops = expand(spec)
    assert len(points) + len(drops) == 3 * 2 * 3 * 2
    for p in points:
        lay = p.spec["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == 2
        assert not (lay["attention"] == "sdpa" and lay["micro_batch_size"] == 1)
    reasons = [d.reason for d in drops]
    assert any("excluded by exclude[0]" in r for r in reasons)
    assert any("excluded by exclude[1]" in r for r in reasons)  # default-valued fields match too
    assert any("not divisible by tp x pp = 3 x 1" in r for r in reasons)
    assert any(r.startswith("workload.global_batch_size:") for r in reasons)
    assert len({p.key for p in points}) == len(points)


def test_grid_over_engines_drops_what_an_engine_cannot_run_with_its_reason():
    spec = parse_sweep(
        {
            "name": "engines",
            "gpus": 4,
            "workload": {**TINY, "model": "tiny-4l", "global_batch_size": 8},
            "grid": {
                "engine": [{"engine": "own"}, {"engine": "deepspeed", "zero_stage": 1}, {"engine": "fsdp"}],
                "parallel": [{"tp": 1, "pp": 1}, {"tp": 2, "pp": 2}, {"tp": 2, "sequence_parallel": True}],
            },
        }
    )
    points, drops = expand(spec)
    assert sorted(p.label().split(" tp")[0] for p in points) == sorted(
        ["own"] * 3 + ["deepspeed ZeRO-1"] + ["FSDP2 reshard"] * 3
    )
    assert sorted(d.reason.split(":")[0] for d in drops) == ["layout.sequence_parallel", "layout.tp"]
    assert all("DeepSpeed" in d.reason for d in drops)


def test_a_grid_value_no_point_runs_is_refused_and_blamed_not_its_neighbours():
    """attention: [flash] leaves every combination invalid, and so every value of every axis without a
    point: the value blamed is the one whose reasons name its own field. A value whose combinations
    were all filtered out, or are duplicates of points kept, is not a mistake."""
    raw = {"name": "g", "gpus": 2, "workload": TINY, "layout": {"engine": "own"}, "points": [{"tp": 2}]}
    grid = {"parallel": [{"tp": 1}, {"tp": 2}], "micro_batch_size": [1, 2], "attention": ["flash"]}
    spec = parse_sweep({**raw, "grid": grid})
    with pytest.raises(SpecError) as e:
        check_grid_values(spec, *expand(spec))
    assert e.value.field == "sweep.grid.attention" and e.value.reason.startswith(
        "flash is invalid in every point it is part of (4; first: layout.attention: 'flash' is not one of "
    )
    filtered = parse_sweep({**raw, "grid": {"micro_batch_size": [1, 2]}, "exclude": [{"micro_batch_size": 2}]})
    check_grid_values(filtered, *expand(filtered))
    duplicate = parse_sweep({**raw, "grid": {"tp": [2]}})  # the listed point again
    check_grid_values(duplicate, *expand(duplicate))


def test_point_key_is_stable_and_ignores_spelling():
    a = parse_sweep({"gpus": 1, "workload": TINY, "grid": {"micro_batch_size": [2]}})
    b = parse_sweep(
        {
            "gpus": 1,
            "workload": dict(reversed(list(TINY.items()))),
            "layout": {"micro_batch_size": 2, "attention": "sdpa"},
            "name": "other",
        }
    )
    (pa,), _ = expand(a)
    (pb,), _ = expand(b)
    assert pa.key == pb.key and len(pa.key) == 16


def test_include_and_duplicates():
    spec = parse_sweep(
        {
            "gpus": 1,
            "workload": TINY,
            "grid": {"micro_batch_size": [1, 2, 4]},
            "include": [{"micro_batch_size": [1, 2]}],
            "points": [{"micro_batch_size": 1}],
        }
    )
    points, drops = expand(spec)
    assert [p.spec["layout"]["micro_batch_size"] for p in points] == [1, 2]
    assert sorted(d.reason.split(" ")[0] for d in drops) == ["duplicate", "not"]


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"workload": TINY}, "sweep.gpus"),
        ({"gpus": 0}, "sweep.gpus"),
        ({"gpus": 1, "grid": {"tpp": [1]}}, "sweep.grid.tpp"),
        ({"gpus": 1, "grid": {"tp": []}}, "sweep.grid.tp"),
        ({"gpus": 1, "bogus": 1}, "sweep.bogus"),
        ({"gpus": 1, "launcher": "mpi"}, "sweep.launcher"),
    ],
)
def test_bad_sweep_specs_name_the_field(raw, field):
    with pytest.raises(SpecError) as e:
        parse_sweep(raw)
    assert e.value.field == field


def test_dry_run_cli_prints_points_and_drops(tmp_path, capsys):
    grid = {"micro_batch_size": [1, 2, 8], "workload.global_batch_size": [4, 8]}  # mb 8 runs with 8 sequences
    path = _write(tmp_path, {"name": "d", "gpus": 1, "workload": TINY, "grid": grid})
    assert cli_main(["sweep", path, "--dry-run", "--store", str(tmp_path / "r.sqlite")]) == 0
    out = capsys.readouterr().out
    assert "5 points, 1 dropped" in out and "8 is not divisible" not in out
    assert "global_batch_size: 4 is not divisible by dp x micro_batch_size = 1 x 8" in out
    assert cli_main(["sweep", str(tmp_path / "missing.yaml"), "--dry-run"]) == 2


def _sweep_procs(spec, store):
    return launch.processes_with_env(launch.SWEEP_ID_ENV, sweep_id(spec, store))


@pytest.mark.slow
def test_fault_sweep_completes_with_right_statuses_and_no_survivors(tmp_path, monkeypatch):
    """Two ranks (own engine, dp 2) per point: a rank is SIGKILLed, a rank hangs, a rank OOMs."""
    monkeypatch.setattr(supervise, "LINGER_S", 5.0)  # after an OOM record, its peers are stuck: kill sooner
    points = [
        {"workload.seed": 1},
        fault_point(2, "kill:1:1"),
        fault_point(3, "hang:1:1", timeout_s=10),  # its whole timeout is waited out: as the slurm test's hang, 10 s
        fault_point(4, "oom:1:0"),
    ]
    raw = tiny_sweep("faults", 2, "own", timeout_s=150, points=points)
    spec = parse_sweep(raw)
    store = str(tmp_path / "r.sqlite")
    counts = run_sweep(spec, launcher="torchrun", store_path=store, timeout_s=150, progress=False)
    by_seed = {r["spec"]["workload"]["seed"]: r for r in ResultsStore(store).records(sweep="faults")}
    assert counts == {"ok": 1, "oom": 1, "failed": 1, "timeout": 1}, {
        k: (r["status"], r["error"]) for k, r in by_seed.items()
    }
    assert by_seed[1]["status"] == "ok" and by_seed[1]["metrics"]["step_time_s"]["n"] == 3
    killed = by_seed[2]
    assert killed["status"] == "failed"  # rank 0 saw its peer vanish; the launcher saw the signal
    assert "SIGKILL" in killed["error"] + killed["launch"]["output_tail"]
    assert by_seed[3]["status"] == "timeout" and by_seed[3]["launch"]["timed_out"]
    assert by_seed[3]["launch"]["timeout_s"] == 10
    assert by_seed[4]["status"] == "oom" and "CUDA out of memory" in by_seed[4]["error"]
    for rec in by_seed.values():  # no process of any run is left: not the launcher, not a rank
        assert launch.processes_with_env(launch.TOKEN_ENV, rec["run_id"]) == []
    assert _sweep_procs(spec, store) == []


@pytest.mark.slow
def test_sigkill_mid_sweep_then_resume_runs_each_point_once(tmp_path):
    raw = tiny_sweep("resume", 1, "single", timeout_s=60, grid={"workload.seed": [1, 2, 3]})
    path = _write(tmp_path, raw)
    store = str(tmp_path / "r.sqlite")
    args = ["sweep", path, "--store", store, "--no-progress", "--launcher", "torchrun"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    first = start_cli(*args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 90
    while time.time() < deadline and not (os.path.exists(store) and ResultsStore(store).records(sweep="resume")):
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = ResultsStore(store).completed_points("resume")
    assert 1 <= len(done_before) < 3
    spec = parse_sweep(raw)
    # the run in flight gets SIGTERM through PR_SET_PDEATHSIG; the rerun reaps anything left
    out = run_cli(*args, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{len(done_before)} already recorded" in out.stdout
    recs = ResultsStore(store).records(sweep="resume")
    per_key = collections.Counter(r["point_key"] for r in recs)
    assert len(per_key) == 3 and set(per_key.values()) == {1}
    assert all(r["status"] == "ok" for r in recs)
    before = {r["point_key"]: r["run_id"] for r in recs}
    for key in done_before:  # completed points were not run again
        assert key in before
    assert _sweep_procs(spec, store) == []
    again = run_cli(*args, cwd=ROOT, env=env, timeout=60)
    assert "3 already recorded, 0 to run" in again.stdout
    assert len(ResultsStore(store).records(sweep="resume")) == 3


@pytest.mark.slow  # bash -n checks the script
def test_slurm_script_generation_and_missing_sbatch(tmp_path, monkeypatch, capsys):
    raw = {
        "name": "big",
        "gpus": 16,
        "nodes": 2,
        "timeout_s": 900,
        "workload": {"model": "paper-13b", "seq_len": 2048, "global_batch_size": 64, "precision": "bf16"},
        "layout": {"engine": "own"},
        "grid": {"tp": [1, 2], "pp": [1, 2]},
        "slurm": {"partition": "gpu", "account": "proj", "setup": ["module load cuda"], "max_parallel": 2},
        "env": {"NCCL_DEBUG": "WARN"},
    }
    path = _write(tmp_path, raw)
    bash = shutil.which("bash")
    monkeypatch.setenv("PATH", str(tmp_path / "nobin"))
    job = tmp_path / "job"
    rc = cli_main(["sweep", path, "--launcher", "slurm", "--store", str(tmp_path / "r.sqlite"), "--job-dir", str(job)])
    err = capsys.readouterr().err
    assert rc == 2 and "error: --launcher slurm: sbatch not found on PATH" in err and "sweep.sbatch" in err
    script = (job / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --nodes=2" in script
    assert "#SBATCH --ntasks-per-node=8" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=proj" in script
    assert "#SBATCH --time=00:20:00" in script and "module load cuda" in script
    assert 'export NCCL_DEBUG="WARN"' in script
    assert 'timeout --signal=TERM --kill-after=60 "$LIMIT" srun --kill-on-bad-exit=1' in script
    assert '-m harness.cli train "$SPEC"' in script and '--sweep "big"' in script
    rows = (job / "points.tsv").read_text().splitlines()
    assert len(rows) == 4
    idx, key, spec_path, limit = rows[1].split("\t")
    assert limit == "900"
    assert (
        yaml.safe_load(open(spec_path))["layout"]["tp"]
        * yaml.safe_load(open(spec_path))["layout"]["pp"]
        * yaml.safe_load(open(spec_path))["layout"]["dp"]
        == 16
    )
    assert subprocess.run([bash, "-n", str(job / "sweep.sbatch")]).returncode == 0


def test_slurm_collect_merges_task_stores_and_classifies_logs(tmp_path):
    spec = parse_sweep({"name": "c", "gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2, 3, 4]}})
    points, _ = expand(spec)
    job = tmp_path / "job"
    write_slurm(spec, points, str(job), timeout_s=60)
    # task 0 wrote its record; task 1 was killed by `timeout`; task 2 printed an OOM; task 3 never ran
    from harness.store import new_record

    rec = new_record(points[0].spec, sweep="c", point_key=points[0].key)
    rec["status"] = "ok"
    ResultsStore(str(job / "stores" / "task-0.sqlite")).write(rec)
    (job / "logs" / "77_1.log").write_text("harness-point x y\nstep 1\nharness-exit 124\n")
    (job / "logs" / "77_2.log").write_text("torch.OutOfMemoryError: CUDA out of memory.\nharness-exit 1\n")
    store = str(tmp_path / "r.sqlite")
    assert collect(spec, str(job), store) == {"merged": 1, "classified": 2, "pending": 1}
    got = {r["point_key"]: r["status"] for r in ResultsStore(store).records(sweep="c")}
    assert got == {points[0].key: "ok", points[1].key: "timeout", points[2].key: "oom"}
    collect(spec, str(job), store)  # idempotent: no duplicates
    assert len(ResultsStore(store).records(sweep="c")) == 3


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "sweeps")) if f.endswith(".yaml")))
def test_ready_made_sweeps_expand(name):
    spec = load_sweep(os.path.join(ROOT, "sweeps", name))
    points, drops = expand(spec)
    assert points, [d.reason for d in drops][:5]
    check_grid_values(spec, points, drops)  # no grid value that no point runs: the command would refuse it
    for p in points:
        lay = p.spec["layout"]
        assert lay["tp"] * lay["pp"] * lay["dp"] == spec.gpus


FAKE_SBATCH = """#!/bin/bash
# stand-in for sbatch: runs every array task of the script here, one after another
script="$1"
last=$(grep -m1 '^#SBATCH --array=' "$script" | sed 's/.*=0-\\([0-9]*\\).*/\\1/')
out=$(grep -m1 '^#SBATCH --output=' "$script" | cut -d= -f2)
for i in $(seq 0 "$last"); do
  log=${out//%A/4242}; log=${log//%a/$i}
  SLURM_ARRAY_JOB_ID=4242 SLURM_ARRAY_TASK_ID=$i bash "$script" > "$log" 2>&1
done
echo "Submitted batch job 4242"
"""
FAKE_SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""


@pytest.mark.slow
def test_slurm_job_array_end_to_end_with_stand_in_sbatch(tmp_path):
    """The generated script really runs: each task trains, fails or times out; collect sorts them."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    points = [{"workload.seed": 1}, fault_point(2, "raise:1"), fault_point(3, "hang:1", timeout_s=10)]
    raw = tiny_sweep("arr", 1, "single", timeout_s=120, points=points)
    path = _write(tmp_path, raw)
    store = str(tmp_path / "r.sqlite")
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": ROOT}
    out = run_cli("sweep", path, "--launcher", "slurm", "--store", store, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0 and "Submitted batch job 4242" in out.stdout, out.stderr[-2000:]
    out = run_cli("sweep", "collect", path, "--store", store, cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 records merged, 1 classified from logs, 0 still pending" in out.stdout
    got = {r["spec"]["workload"]["seed"]: r["status"] for r in ResultsStore(store).records(sweep="arr")}
    assert got == {1: "ok", 2: "failed", 3: "timeout"}, out.stdout
    dry = run_cli("sweep", path, "--dry-run", "--store", store, cwd=ROOT, env=env, timeout=60)
    assert dry.stdout.count("skipped]") == 3


@pytest.mark.slow
def test_deepspeed_launcher_points_and_hang_cleanup(tmp_path):
    """The same sweep through the `deepspeed` launcher (runner -> launch -> ranks): an ok point
    and a hung one that is killed at its timeout with nothing left behind."""
    points = [{"workload.seed": 1}, fault_point(2, "hang:1:0", timeout_s=15)]
    raw = tiny_sweep("dsl", 2, "own", timeout_s=150, points=points)
    spec = parse_sweep(raw)
    store = str(tmp_path / "r.sqlite")
    counts = run_sweep(spec, launcher="deepspeed", store_path=store, timeout_s=150, progress=False)
    recs = ResultsStore(store).records(sweep="dsl")
    assert counts == {"ok": 1, "oom": 0, "failed": 0, "timeout": 1}, [(r["status"], r["error"]) for r in recs]
    assert all("deepspeed.launcher.runner" in r["launch"]["command"] for r in recs)
    for rec in recs:
        assert launch.processes_with_env(launch.TOKEN_ENV, rec["run_id"]) == []
    assert _sweep_procs(spec, store) == []


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_kills_the_run_in_flight_and_exits_130(tmp_path, sig):
    raw = tiny_sweep("intr", 1, "single", points=[{"env": {"HARNESS_FAULT": "hang:1"}}])
    path = _write(tmp_path, raw)
    store = str(tmp_path / "r.sqlite")
    spec = parse_sweep(raw)
    args = ["sweep", path, "--store", store, "--no-progress", "--launcher", "direct"]
    proc = start_cli(
        *args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # Ctrl-C's disposition, whatever this suite inherited: a shell without job control starts a background
        # command (`cmd &`) with SIGINT ignored, which Python and the CLI then keep (the run would hang to its end)
        preexec_fn=_default_sigint,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not _sweep_procs(spec, store):
        time.sleep(0.2)
    assert _sweep_procs(spec, store), "the run never started"
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "run the same command to resume" in out
    assert _sweep_procs(spec, store) == []
    assert ResultsStore(store).records(sweep="intr") == []  # an interrupted point is not a result


# ------------------------------------------------------------------ context parallelism


def test_cp_and_cp_impl_are_grid_axes_with_dp_derived_and_refusals_dropped_with_reasons():
    spec = parse_sweep(
        {
            "name": "cp",
            "gpus": 4,
            "workload": {**TINY, "seq_len": 64},
            "grid": {
                "engine": [{"engine": "own", "attention": "naive"}, {"engine": "megatron", "attention": "naive"}],
                "cp": [1, 2, 3],
                "layout.cp_impl": ["ring", "ulysses"],
            },
        }
    )
    points, drops = expand(spec)
    lays = [p.spec["layout"] for p in points]
    assert all(ParallelDims.of(lay).world == 4 for lay in lays)
    assert {(lay["cp"], lay["dp"]) for lay in lays} <= {(1, 4), (2, 2)}
    reasons = [d.reason for d in drops]
    assert any(r == "layout: 4 GPUs are not divisible by tp x cp x pp = 1 x 3 x 1" for r in reasons)
    assert any(r.startswith("layout.cp: ") and "Transformer Engine" in r for r in reasons)  # megatron, for good
    assert any(r.startswith("duplicate of point") for r in reasons)  # cp_impl means nothing at cp 1
    cp1 = collections.Counter(lay["engine"] for lay in lays if lay["cp"] == 1)
    assert cp1 == {"own": 1, "megatron": 1}
    assert all("cp2 ring" in p.label() or "cp2 ulysses" in p.label() for p in points if p.spec["layout"]["cp"] == 2)


def test_a_point_without_cp_keeps_the_key_it_had_before_cp_existed():
    """Keys computed by the harness before layout.cp and layout.cp_impl were fields (a sweep resumed
    after the update skips the points its store holds)."""
    spec = parse_sweep({"name": "k", "gpus": 2, "workload": TINY, "layout": {"engine": "own"}, "grid": {"tp": [1, 2]}})
    assert [p.key for p in expand(spec)[0]] == ["341e63cf1de7c56f", "2613eb35276c4396"]
    cp2 = parse_sweep(
        {
            "name": "k",
            "gpus": 2,
            "workload": TINY,
            "grid": {"cp_impl": ["ring", "allgather"]},
            "layout": {"engine": "own", "cp": 2, "attention": "naive"},
        }
    )
    points, drops = expand(cp2)  # at cp 2 the implementation is part of the key: two points (or two refusals)
    assert len(points) + len(drops) == 2 and len({p.key for p in points}) == len(points)
    assert not any(d.reason.startswith("duplicate") for d in drops)
