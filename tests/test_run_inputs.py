"""Inputs that ran, crashed or destroyed things (issue 24, point 5, the run-level items).

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
import json
import math
import os
import stat

import pytest
import yaml

from harness import launch
from harness.cli import main as cli_main
from harness.store import ResultsStore

WORKLOAD = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1,
            "device": "cpu", "precision": "fp32"}
GOOD = "hello world\n" * 50


def _never_launch(*args, **kwargs):
    pytest.fail("launched a run although the input is refused before any launch")


@pytest.fixture
def nothing_launches(monkeypatch, no_launch):
    """In tmp_path; every way compare and sweep launch a run fails the test."""
    from harness.compare import orchestrate
    from harness.commands import sweep as sweep_cmd

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
