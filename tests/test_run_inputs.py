"""Inputs that ran, crashed or destroyed things (the run-level items).

- an --out that is a FIFO, a folder or a link to /dev/null is refused, and nothing is renamed over it;
- a run whose loss becomes non-finite stops there and is recorded failed, with the step;
- whatever can be checked is checked before the first launch (kernels this machine cannot run,
  a launcher that cannot start the run's processes, a comparison with nothing to compare, an
  --emit-sweep that cannot be written);
- options that were silently ignored (report --baselines, results export --sweep) are refused;
- a report that cannot be written completely is one line and leaves no partial file.

In-process through harness.cli.main with the launch functions replaced by ones that fail the
test: a refusal must come before anything launches. A process start fails a quick test
(tests/conftest.py).
"""

from __future__ import annotations

import errno
import math
import os
import stat

import pytest
import yaml
from conftest import IN_PROCESS_SWEEP, run_spec_in

from harness import launch
from harness.cli import main as cli_main
from harness.store import ResultsStore
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload(global_batch_size=4)
GOOD = "hello world\n" * 50


def _never_launch(*args, **kwargs):
    pytest.fail("launched a run although the input is refused before any launch")


@pytest.fixture
def nothing_launches(monkeypatch, no_launch):
    """In tmp_path; every way compare and sweep launch a run fails the test."""
    from harness.commands import sweep as sweep_cmd
    from harness.compare import orchestrate

    monkeypatch.setattr(launch, "run_spec", _never_launch)
    monkeypatch.setattr(orchestrate, "run_comparison", _never_launch)
    monkeypatch.setattr(sweep_cmd, "run_sweep", _never_launch)
    return no_launch


def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(".") or n.endswith(".tmp"))


# ---------------------------------------------------------------- data prepare --out


@pytest.mark.parametrize("kind", ["fifo", "folder", "link-to-dev-null", "sidecar-fifo", "sidecar-folder"])
def test_prepare_refuses_an_out_that_is_not_a_regular_file(no_launch, one_line_error, kind):
    (no_launch / "t.txt").write_text(GOOD)
    out = no_launch / "out.bin"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "folder":
        out.mkdir()
    elif kind == "link-to-dev-null":
        out.symlink_to(os.devnull)
    elif kind == "sidecar-fifo":
        os.mkfifo(str(out) + ".json")
    else:
        os.mkdir(str(out) + ".json")
    before = {p.name: (os.lstat(p).st_mode, os.path.islink(p)) for p in no_launch.iterdir()}
    line = one_line_error(cli_main(["data", "prepare", "t.txt", "--out", "out.bin"]))
    assert line.startswith("error: --out: ") and "out.bin" in line, line
    after = {p.name: (os.lstat(p).st_mode, os.path.islink(p)) for p in no_launch.iterdir()}
    assert after == before  # nothing renamed over it, no sidecar appeared, no temporary left
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_prepare_through_a_link_to_a_file_keeps_the_link(no_launch):
    (no_launch / "t.txt").write_text(GOOD)
    (no_launch / "real.bin").write_bytes(b"old")
    (no_launch / "out.bin").symlink_to("real.bin")
    assert cli_main(["data", "prepare", "t.txt", "--out", "out.bin"]) == 0
    assert os.path.islink(no_launch / "out.bin") and (no_launch / "real.bin").stat().st_size == 2 * (len(GOOD) + 1)
    assert _leftovers(no_launch) == []


# ---------------------------------------------------------------- a diverged run


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_diverged_run_is_failed_with_its_step_and_train_exits_1(no_launch, capsys, monkeypatch, bad):
    """The loss of step 3 of 7 becomes non-finite (as `optimizer.lr: 1e30` makes it, whatever range
    the spec allows lr): the run stops there, failed, and no step after it runs."""
    from harness.run import Trainer

    real, ran = Trainer._train_step, []

    def step(self, i, batch):
        ran.append(i)
        return bad if i == 2 else real(self, i, batch)

    monkeypatch.setattr(Trainer, "_train_step", step)
    store = str(no_launch / "r.sqlite")
    (no_launch / "t.yaml").write_text(yaml.safe_dump({"workload": {**WORKLOAD, "steps": 6}, "store": store}))
    assert cli_main(["train", "t.yaml", "--no-progress"]) == 1
    (rec,) = ResultsStore(store).records()
    losses = rec["metrics"]["losses"]
    assert ran == [0, 1, 2] and len(losses) == 3 and all(map(math.isfinite, losses[:2])) and losses[2] is not None
    assert rec["status"] == "failed" and rec["diverged_at_step"] == 3
    assert rec["error"].startswith(f"diverged: the loss became {bad} at step 3 of 7")
    assert "step_time_s" not in rec["metrics"]  # not a measurement
    out = capsys.readouterr().out
    assert ": failed" in out and "diverged" in out

    from harness.report.analysis import failures
    from harness.report.data import to_row
    from harness.store.fields import row

    assert row(rec)["diverged_at_step"] == len(losses)
    table = failures([to_row(rec)]).tables[0]
    assert table.rows[0][1] == "failed" and table.rows[0][3].startswith("diverged: the loss became")


def test_a_skipped_update_is_a_diverged_run_at_that_step(no_launch, monkeypatch):
    """DeepSpeed (and Megatron) skip an update whose gradient norm is not finite, at a step whose loss
    was still finite: the run is diverged there, with the framework's reason, not a crash."""
    import types

    from harness.errors import NonFiniteStep
    from harness.frameworks.deepspeed.common import DeepSpeedBase
    from harness.run import Trainer

    skipped = types.SimpleNamespace(
        engine=types.SimpleNamespace(skipped_steps=1), _skipped_steps=0, optimizer=types.SimpleNamespace()
    )
    with pytest.raises(NonFiniteStep, match="gradient norm was not finite"):
        DeepSpeedBase.check_step_applied(skipped)

    real = Trainer._train_step

    def step(self, i, batch):
        if i == 1:
            DeepSpeedBase.check_step_applied(skipped)
        return real(self, i, batch)

    monkeypatch.setattr(Trainer, "_train_step", step)
    store = str(no_launch / "r.sqlite")
    (no_launch / "t.yaml").write_text(yaml.safe_dump({"workload": {**WORKLOAD, "steps": 6}, "store": store}))
    assert cli_main(["train", "t.yaml", "--no-progress"]) == 1
    (rec,) = ResultsStore(store).records()
    assert rec["status"] == "failed" and rec["diverged_at_step"] == 2 and len(rec["metrics"]["losses"]) == 1
    assert rec["error"].startswith(
        "diverged: DeepSpeed skipped the optimizer step (SimpleNamespace: the gradient norm was not finite)"
    ), rec["error"]


def _in_process(diverging):
    """A launch function that runs each 1-process spec here (harness.run.run), its loss becoming
    non-finite at step 2 where diverging(spec dict) says so."""
    import torch

    from harness.run import Trainer, run
    from harness.runtime import RunContext
    from harness.spec import parse_spec

    real = Trainer._train_step

    def launch_fn(spec, *, store_path, sweep=None, point_key=None, **_):
        with pytest.MonkeyPatch.context() as mp:
            if diverging(spec):
                mp.setattr(Trainer, "_train_step", lambda self, i, batch: math.nan if i == 1 else real(self, i, batch))
            return run(
                parse_spec(spec),
                RunContext(0, 1, 0, torch.device("cpu"), None),
                store_path=store_path,
                sweep=sweep,
                point_key=point_key,
                progress=False,
            )

    return launch_fn


def test_a_diverged_run_fails_its_comparison_and_is_a_failed_sweep_point(no_launch):
    from harness.compare.orchestrate import run_comparison
    from harness.compare.spec import parse_compare_spec
    from harness.sweep.execute import run_sweep
    from harness.sweep.spec import parse_sweep

    cs = parse_compare_spec(
        {
            "name": "d",
            "parity_steps": 2,
            "workload": WORKLOAD,
            "runs": [{"engine": "single", "label": "hot", "attention": "naive"}],
        }
    )
    hot = _in_process(lambda spec: spec["layout"]["attention"] == "naive")
    summary = run_comparison(cs, store_path=str(no_launch / "c.sqlite"), progress=False, launch_fn=hot)
    assert summary["verdict"] == "FAIL" and summary["failed_runs"] == ["hot"]
    (entry,) = [p for p in summary["parity"]["runs"] if p["label"] == "hot"]
    assert entry["verdict"] != "pass"

    store = str(no_launch / "s.sqlite")
    sweep = parse_sweep({"name": "s", "gpus": 1, "workload": WORKLOAD, "grid": {"attention": ["naive", "sdpa"]}})
    launch_run_spec = launch.run_spec
    try:
        launch.run_spec = hot
        counts = run_sweep(
            sweep, store_path=store, echo=lambda *_: None, log_dir=str(no_launch / "logs"), **IN_PROCESS_SWEEP
        )
    finally:
        launch.run_spec = launch_run_spec
    assert counts["failed"] == 1 and counts["ok"] == 1
    (bad,) = ResultsStore(store).records(status="failed")
    assert bad["spec"]["layout"]["attention"] == "naive" and bad["diverged_at_step"] == 2


# ---------------------------------------------------------------- checked before the first launch

COMPARE = {"name": "c", "nproc": 2, "parity_steps": 2, "workload": WORKLOAD}


@pytest.mark.parametrize(
    "case, extra, start",
    [
        (
            "kernel this machine cannot run",
            {"runs": [{"engine": "own", "dp": 2, "attention": "sdpa_efficient"}]},
            "error: layout.attention (run 'own dp2'): sdpa_efficient cannot run on cpu",
        ),
        (
            "direct launcher for 2 processes",
            {"runs": [{"engine": "own", "dp": 2, "launcher": "direct"}]},
            "error: launcher (run 'own dp2'): direct starts one process; this run needs 2",
        ),
        (
            "the only matrix cell cannot run",
            {
                "nproc": 4,
                "matrix": {"engines": [{"engine": "deepspeed", "zero_stage": 1}], "layouts": [{"tp": 2, "pp": 2}]},
            },
            "error: matrix: no run can be launched besides the reference: deepspeed ZeRO-1 tp2 pp2: layout.tp: ",
        ),
    ],
)
def test_compare_refuses_before_the_first_launch(nothing_launches, one_line_error, case, extra, start):
    (nothing_launches / "c.yaml").write_text(yaml.safe_dump({**COMPARE, **extra}))
    line = one_line_error(cli_main(["compare", "c.yaml", "--out", "out", "--store", "r.sqlite", "--no-progress"]))
    assert line.startswith(start), line
    assert not os.path.exists(nothing_launches / "out" / "compare-c.md")


SWEEP = {
    "name": "s",
    "gpus": 1,
    "launcher": "direct",
    "workload": WORKLOAD,
    "grid": {"attention": ["sdpa", "sdpa_efficient"]},
}


def test_sweep_with_a_kernel_this_machine_cannot_run_is_refused_before_any_point(nothing_launches, one_line_error):
    (nothing_launches / "s.yaml").write_text(yaml.safe_dump(SWEEP))
    line = one_line_error(cli_main(["sweep", "s.yaml", "--no-progress"]))
    point = "single tp1 pp1 dp1 mb1 ckpt=none sdpa_efficient/torch"
    assert line.startswith(f"error: layout.attention (point '{point}'): "), line
    assert "sdpa_efficient cannot run on cpu" in line and line.endswith("nothing was launched")
    assert not os.path.exists(nothing_launches / "results.sqlite")


def test_under_slurm_the_kernels_are_left_to_the_nodes(nothing_launches):
    (nothing_launches / "s.yaml").write_text(yaml.safe_dump(SWEEP))
    assert cli_main(["sweep", "s.yaml", "--launcher", "slurm", "--no-submit", "--job-dir", "job"]) == 0
    assert (nothing_launches / "job").is_dir()  # the job array is written: another machine runs it


def test_launching_direct_for_two_processes_is_one_line():
    from harness.errors import SpecError

    with pytest.raises(SpecError, match="direct starts one process; this run needs 2"):
        launch.build_command("direct", 2, ["train"])


TINY_PLAN = [*"plan --model tiny --seq-len 64 --global-batch-size 8 --gpus 2 --hardware cpu --rmsnorm torch".split()]


@pytest.fixture
def plan_never_computed(monkeypatch, no_launch):
    import importlib

    predict = importlib.import_module("harness.planner.predict")  # the package's `predict` is a function
    monkeypatch.setattr(predict, "predict_many", lambda *a, **k: pytest.fail("the plan was computed first"))
    return no_launch


def test_emit_sweep_into_a_missing_folder_is_refused_before_the_plan(plan_never_computed, one_line_error):
    line = one_line_error(cli_main([*TINY_PLAN, "--emit-sweep", "nope/top.yaml"]))
    assert line.startswith("error: --emit-sweep: ") and "nope" in line, line


def test_emit_sweep_on_a_read_only_file_system_is_refused_before_the_plan(
    plan_never_computed, one_line_error, monkeypatch
):
    """As root, permission bits say nothing: only creating a file tells (here a read-only file system)."""
    import tempfile

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    line = one_line_error(cli_main([*TINY_PLAN, "--emit-sweep", "top.yaml"]))
    assert line == "error: --emit-sweep: cannot write top.yaml: Read-only file system", line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a folder whatever its mode")
def test_emit_sweep_into_a_read_only_folder_is_refused_before_the_plan(plan_never_computed, one_line_error):
    (plan_never_computed / "ro").mkdir(mode=0o555)
    line = one_line_error(cli_main([*TINY_PLAN, "--emit-sweep", "ro/top.yaml"]))
    assert line.startswith("error: --emit-sweep: "), line


# ---------------------------------------------------------------- options that were silently ignored


@pytest.fixture
def store_of_records(no_launch):
    from harness.testing.synthetic import make_records

    store = ResultsStore(str(no_launch / "r.sqlite"))
    for rec in make_records(10):
        store.write(rec)
    return store


@pytest.mark.parametrize(
    "args, start",
    [
        (["report", "--out", "rep", "--baselines", "nope"], "error: --baselines: nope is missing"),
        (["report", "--out", "rep", "--baselines", "r.sqlite"], "error: --baselines: r.sqlite is a file"),
        (["report", "--out", "rep", "--baselines", "rep"], "error: --baselines: rep holds no published figures"),
        (["report", "--out", "rep", "--sweep", "syn-8gpu-node", "--sweep", "nope"], "error: --sweep: no sweep 'nope'"),
        (["results", "export", "--sweep", "nope"], "error: --sweep: no sweep 'nope' in r.sqlite; it holds syn-"),
    ],
)
def test_an_option_that_would_be_ignored_is_refused(store_of_records, one_line_error, args, start):
    os.makedirs("rep")
    line = one_line_error(cli_main([*args, "--store", "r.sqlite"]))
    assert line.startswith(start), line
    assert os.listdir("rep") == []


def test_export_of_a_known_sweep_without_records_of_a_status_is_empty_not_an_error(store_of_records, capsys):
    args = ["results", "export", "--store", "r.sqlite", "--sweep", "syn-8gpu-node", "--status", "timeout"]
    assert cli_main(args) == 0 and capsys.readouterr().out == ""


# ---------------------------------------------------------------- a report on a full disk


def test_a_report_on_a_full_disk_is_one_line_and_leaves_the_earlier_report(store_of_records, one_line_error):
    import builtins

    os.makedirs("rep/img")
    for name in ("report.md", "report.html"):
        with open(os.path.join("rep", name), "w") as f:
            f.write("earlier\n")
    real_open = builtins.open

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and "report.html" in os.path.basename(str(path)):
            real_write = f.write

            def write(data):  # half of it fits
                real_write(data[: len(data) // 2])
                f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            f.write = write
        return f

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", full_disk_open)
        rc = cli_main(["report", "--store", "r.sqlite", "--out", "rep"])
    line = one_line_error(rc)
    assert line.startswith("error: --out: cannot write ") and line.endswith("No space left on device"), line
    assert sorted(os.listdir("rep")) == ["img", "report.html", "report.md"] and os.listdir("rep/img") == []
    assert all(open(os.path.join("rep", n)).read() == "earlier\n" for n in ("report.md", "report.html"))


@pytest.mark.slow
def test_the_kernel_check_in_a_child_process_answers_like_the_one_in_process():
    """On CUDA the launching process tries the kernels in a child (no CUDA context of its own);
    here the same protocol on CPU, where the in-process answer is known."""
    from harness.model.kernels import probe_in_child

    bad, good = ("sdpa_efficient", "torch", "cpu", "fp32", 16), ("sdpa", "torch", "cpu", "fp32", 16)
    failed = probe_in_child([bad, good])
    assert list(failed) == [bad] and failed[bad][0] == "layout.attention"
    assert failed[bad][1].startswith("sdpa_efficient cannot run on cpu")


@pytest.mark.slow
def test_a_diverged_two_process_run_stops_on_every_rank_and_leads_with_its_cause(tmp_path):
    """Real ranks under torchrun: both stop at the step whose loss is NaN (HARNESS_FAULT=nan, as
    `optimizer.lr: 1e30` does by step 3), the record says so first, not 'rank N failed first'."""
    spec = {"workload": {**WORKLOAD, "steps": 6}, "layout": {"engine": "own", "dp": 2}}
    rec = run_spec_in(tmp_path, spec, 2, "torchrun", 240, extra_env={"HARNESS_FAULT": "nan:2"})
    assert rec["status"] == "failed" and rec["diverged_at_step"] == 3 and len(rec["metrics"]["losses"]) == 3
    assert rec["error"].startswith("diverged: the loss became nan at step 3 of 7"), rec["error"]
    assert "first_failure" not in rec and not rec["launch"]["timed_out"] and rec["launch"]["exit_code"] == 1
