"""Paths: the main command leaves tracked files alone, and records and reports
keep paths as they were given, so committed ones name no folder of the machine that made them.

- no committed report, record, example or sweep spec holds an absolute path of a machine;
- a default `harness compare` writes where git does not track (harness-out/, ignored), never over
  the committed example under reports/;
- a relative store, log folder and ds_config stay relative in the records, the compare summary
  and the commands the launcher records (checked with the launches replaced: nothing starts).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import IN_PROCESS_SWEEP, ok_run_spec

from harness import launch
from harness.cli import build_parser
from harness.cli import main as cli_main
from harness.commands.compare import DEFAULT_OUT, default_log_dir
from harness.compare.spec import DEFAULT
from harness.frameworks.deepspeed.config import build_config
from harness.launch import supervise
from harness.spec import parse_spec
from harness.store import ResultsStore, new_record

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = ("reports", "examples", "sweeps")
# A folder of some machine: Unix temp and home folders, this project's work tree, macOS and Windows.
ABSOLUTE = re.compile(
    r"(?<![\w.$~-])(/tmp/|/home/|/work/|/root/|/Users/|/private/var/|/var/folders/|/scratch/)"
    r"|\b[A-Za-z]:\\{1,2}[\w.]"
)
# Images embedded in HTML reports: base64 may spell anything, it is not text to check.
EMBEDDED = re.compile(r"data:[\w/+.-]+;base64,[A-Za-z0-9+/=]+")
TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}


def _git(*args) -> subprocess.CompletedProcess | None:
    if shutil.which("git") is None or not os.path.isdir(os.path.join(REPO, ".git")):
        return None
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def _committed_text_files():
    for top in COMMITTED:
        for folder, _, names in os.walk(os.path.join(REPO, top)):
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as f:
                    raw = f.read()
                if b"\0" in raw:
                    continue  # an image
                try:
                    yield os.path.relpath(path, REPO), raw.decode("utf-8")
                except UnicodeDecodeError:
                    continue


def test_no_committed_file_names_a_folder_of_the_machine_that_made_it():
    found = []
    for rel, text in _committed_text_files():
        for n, line in enumerate(EMBEDDED.sub("data:", text).splitlines(), 1):
            m = ABSOLUTE.search(line)
            if m:
                found.append(f"{rel}:{n}: ...{line[max(0, m.start() - 40) : m.end() + 40]}...")
    assert not found, "absolute paths in committed files:\n" + "\n".join(found[:20])


def test_the_path_check_finds_what_it_must():
    for bad in (
        '"store": "/tmp/default2.sqlite"',
        "results store `/work/main/x`",
        '"log": "/root/out/a.log"',
        "C:\\Users\\me\\x",
        '"C:\\\\runs\\\\a"',
        "/home/u/x",
        "/Users/me/x",
    ):
        assert ABSOLUTE.search(bad), bad
    for fine in (
        "harness-out/compare-x.md",
        "ds_configs/zero1.json",
        "$OUT/results.sqlite",
        "results.sqlite",
        "https://example.org/home/x",
        "a 1/tmp/ ratio",
        "tokens/s per device",
    ):
        assert not ABSOLUTE.search(fine), fine


@pytest.mark.slow  # asks git what it tracks and ignores (a process)
def test_default_compare_output_is_not_a_tracked_file():
    parser, _ = build_parser(["compare"])
    args = parser.parse_args(["compare"])
    assert args.out == DEFAULT_OUT and not os.path.isabs(args.out)
    outputs = [os.path.join(args.out, f"compare-{DEFAULT['name']}{ext}") for ext in (".md", ".html", ".json")]
    logs = default_log_dir("results.sqlite", DEFAULT["name"])
    assert logs == os.path.join("harness-logs", f"compare-{DEFAULT['name']}")
    for path in outputs + [logs]:
        assert not os.path.normpath(path).startswith("reports" + os.sep), path
    git = _git("ls-files", "--", *outputs, logs)
    if git is None:
        pytest.skip("not a git checkout")
    assert git.returncode == 0 and git.stdout.strip() == "", git.stdout  # none of them tracked
    ignored = _git("check-ignore", "--no-index", *outputs, os.path.join(logs, "x.log"))
    assert len(ignored.stdout.split()) == len(outputs) + 1, ignored.stdout  # and all ignored


def test_the_committed_example_is_where_a_default_run_does_not_write():
    assert os.path.isfile(os.path.join(REPO, "reports", f"compare-{DEFAULT['name']}.md"))
    assert os.path.normpath(DEFAULT_OUT) != "reports"


# ---------------------------------------------------------------- paths as given


def test_a_relative_store_stays_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = ResultsStore(os.path.join("sub", "r.sqlite"))
    rec = new_record({"store": os.path.join("sub", "r.sqlite"), "workload": TINY, "layout": {"engine": "single"}})
    rec["status"] = "ok"
    store.write(rec)
    assert store.path == os.path.join("sub", "r.sqlite")
    assert ResultsStore(store.path).get(rec["run_id"])["spec"]["store"] == os.path.join("sub", "r.sqlite")


def test_default_ds_config_is_recorded_by_its_name_and_a_given_one_as_given(tmp_path, monkeypatch):
    layout = {"engine": "deepspeed", "dp": 2, "micro_batch_size": 2}
    _, name, _ = build_config(parse_spec({"workload": TINY, "layout": {**layout, "zero_stage": 1}}), device_type="cpu")
    assert name == "ds_configs/zero1.json"
    _, name, _ = build_config(
        parse_spec({"workload": TINY, "layout": {**layout, "zero_stage": 3, "ds_config": "ds_configs/zero3.json"}}),
        device_type="cpu",
    )
    assert name == "ds_configs/zero3.json"
    monkeypatch.chdir(tmp_path)  # given relative to the working directory: found there, recorded so
    shutil.copy(os.path.join(REPO, "ds_configs", "zero2.json"), tmp_path / "mine.json")
    _, name, _ = build_config(
        parse_spec({"workload": TINY, "layout": {**layout, "zero_stage": 2, "ds_config": "mine.json"}}),
        device_type="cpu",
    )
    assert name == "mine.json"


def test_launch_passes_and_records_paths_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = {}

    class Stop(Exception):
        pass

    def build_command(launcher, nproc, argv, **kw):
        seen["argv"] = argv
        raise Stop

    monkeypatch.setattr(supervise, "build_command", build_command)
    with pytest.raises(Stop):
        launch.run_spec(
            {"workload": TINY, "layout": {"engine": "single"}},
            nproc=1,
            launcher="direct",
            store_path="r.sqlite",
            timeout_s=10,
            log_dir=os.path.join("logs", "x"),
        )
    argv = seen["argv"]
    assert argv[argv.index("--store") + 1] == "r.sqlite"
    assert argv[1].startswith(os.path.join("logs", "x") + os.sep)  # the run's spec file
    cmd = [sys.executable, "-m", "harness.cli", *argv]
    assert launch.recorded_command(cmd) == ["python", "-m", "harness.cli", *argv]
    assert launch.recorded_command(["srun", "x"]) == ["srun", "x"]


def test_compare_keeps_store_logs_and_ds_config_as_given(tmp_path, monkeypatch, capsys):
    """`harness compare c.yaml --store r.sqlite` with the launches replaced: the report goes to
    harness-out/, and the store, the logs and a ds_config are named as given everywhere."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "c",
                "nproc": 2,
                "parity_steps": 1,
                "workload": TINY,
                "runs": [{"engine": "deepspeed", "zero_stage": 2, "ds_config": "ds_configs/zero2.json"}],
            }
        )
    )
    calls = []

    def run_spec(spec, *, store_path, sweep, point_key, log_dir, launcher, **kw):
        calls.append({"spec": spec, "store_path": store_path, "log_dir": log_dir})
        rec = new_record(spec, sweep=sweep, point_key=point_key)
        rec.update(status="ok", metrics={"losses": [5.0, 4.9], "step_time_s": {"median": 0.01}})
        rec["launch"] = {"launcher": launcher, "log": os.path.join(log_dir, rec["run_id"] + ".log"), "wall_s": 1.0}
        ResultsStore(store_path).write(rec)
        return rec

    monkeypatch.setattr(launch, "run_spec", run_spec)
    assert cli_main(["compare", "c.yaml", "--store", "r.sqlite", "--no-progress"]) == 0, capsys.readouterr().err
    assert {"compare-c.html", "compare-c.json", "compare-c.md"} <= set(os.listdir(tmp_path / DEFAULT_OUT))
    assert all(c["store_path"] == "r.sqlite" and c["spec"]["store"] == "r.sqlite" for c in calls)
    assert all(c["log_dir"] == os.path.join("harness-logs", "compare-c") for c in calls)
    ds = next(c["spec"] for c in calls if c["spec"]["layout"]["engine"] == "deepspeed")
    assert ds["layout"]["ds_config"] == "ds_configs/zero2.json"
    summary = json.loads((tmp_path / DEFAULT_OUT / "compare-c.json").read_text())
    assert summary["store"] == "r.sqlite"
    assert all(not os.path.isabs(r["log"]) for r in summary["runs"])
    for rec in ResultsStore("r.sqlite").records():
        assert rec["spec"]["store"] == "r.sqlite" and not os.path.isabs(rec["launch"]["log"])


def test_sweep_logs_go_next_to_a_relative_store_as_given(tmp_path, monkeypatch):
    from harness.sweep.execute import run_sweep
    from harness.sweep.spec import parse_sweep

    monkeypatch.chdir(tmp_path)
    dirs = []
    monkeypatch.setattr(launch, "run_spec", ok_run_spec(dirs, "log_dir"))
    os.mkdir("out")
    spec = parse_sweep({"name": "s", "gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2]}})
    run_sweep(spec, store_path=os.path.join("out", "r.sqlite"), echo=lambda *a: None, **IN_PROCESS_SWEEP)
    assert dirs == [os.path.join("out", "harness-logs", "s")] * 2
