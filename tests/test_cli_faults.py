"""What a mistyped argument, a killed DeepSpeed build, a second comparison and an early Ctrl-C do:
one `error:` line and exit 2 for an argparse mistake (no usage dump); a stale torch-extension build
lock removed before a run is launched (it would hang the run until its timeout); a second comparison
into the same report refused before it launches; exit 130 and no traceback for a Ctrl-C at any
point of the imports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import tomllib
import yaml
from conftest import run_spec_in

from harness import cli, launch
from harness.launch import build_lock, supervise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- argparse mistakes: one line

ARGPARSE_MISTAKES = [  # (argv, the whole line)
    (
        ["trian"],
        "error: command: 'trian' is not one of train, env, data, results, compare, sweep, report, plan, "
        "memory, import (did you mean train?)",
    ),
    (["train", "a.yaml", "b.yaml"], "error: b.yaml: one argument too many for harness train; see harness train --help"),
    (["compare", "--nproc", "2"], "error: --nproc: not an option of harness compare; see harness compare --help"),
    (["plan", "--seq-len", "2048.0"], "error: --seq-len: invalid int value: '2048.0'"),
    (["plan", "--export", "nemo"], "error: --export: 'nemo' is not one of deepspeed, megatron, torchtitan"),
    (["memory"], "error: spec: missing; see harness memory --help"),
    (["results", "export", "--format", "xml"], "error: --format: 'xml' is not one of jsonl, csv"),
    (["results"], "error: action: missing: one of export; see harness results --help"),
    (["data", "prepare"], "error: inputs: missing (and --out); see harness data prepare --help"),
    (["sweep"], "error: SPEC.yaml: missing; see harness sweep --help"),
    (["plan", "--seq", "8"], "error: --seq: ambiguous: could be --seq-len, --sequence-parallel"),
    (["plan", "--seq-len"], "error: --seq-len: expected one argument"),
    (
        ["plan", "--seqlen=8"],
        "error: --seqlen: not an option of harness plan (did you mean --seq-len?); see harness plan --help",
    ),
    (["compare", "--timeout", "abc"], "error: --timeout: invalid float value: 'abc'"),
    (["env", "--device", "gpu"], "error: --device: 'gpu' is not one of auto, cpu, cuda (did you mean cpu?)"),
    (["sweep", "s.yaml", "--launcher", "mpirun"], "error: --launcher: 'mpirun' is not one of "),
    (["--bogus"], "error: --bogus: not an option of harness; see harness --help"),
    (["report"], "error: --out: missing; see harness report --help"),
]


@pytest.mark.parametrize("argv, line", ARGPARSE_MISTAKES, ids=[" ".join(a) for a, _ in ARGPARSE_MISTAKES])
def test_an_argparse_mistake_is_one_error_line_and_exit_2(argv, line, no_launch, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (rc, out)
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line: no usage dump
    assert err.startswith(line) and err.startswith("error: "), err


def _parsers(parser):
    yield parser
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for sub in action.choices.values():
            yield from _parsers(sub)


def test_a_mistake_every_rank_makes_is_said_by_one_of_them(monkeypatch, tmp_path):
    """Ranks of one launch (same launcher process, port and run id) that reach the same mistake say it
    once between them; a single process, another launch or another mistake is said as usual."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the markers go here
    launch_env = {"WORLD_SIZE": "2", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "a"}
    line = "error: layout: world size 2 != tp x cp x pp x dp = 1 x 1 x 1 x 4"
    assert cli.first_to_say(line, launch_env) and not cli.first_to_say(line, launch_env)  # rank 0, then rank 1
    assert cli.first_to_say(line, {**launch_env, "TORCHELASTIC_RUN_ID": "b"})  # the next launch
    assert cli.first_to_say(line + "!", launch_env)
    assert cli.first_to_say(line, {}) and cli.first_to_say(line, {})  # one process: every time


@pytest.mark.slow
def test_a_world_size_mistake_under_torchrun_is_one_line_from_exit_2_ranks(tmp_path):
    """Two ranks under torchrun given a layout for four: the line once (it was once per rank), every rank
    exits 2 (torchrun's own summary of failed ranks, and its exit status 1, are torchrun's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "harness.cli", "train"]
    cmd += "--set layout.engine=own --set layout.dp=4 --set workload.device=cpu --store r.sqlite".split()
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    said = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert said == ["error: layout: world size 2 != tp x cp x pp x dp = 1 x 1 x 1 x 4"], out.stderr[-3000:]
    assert "exitcode: 2" in out.stderr and "exitcode: 1 " not in out.stderr
    assert not os.path.exists(tmp_path / "r.sqlite")  # refused before the run: no record


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_parser_refuses_in_one_line(command):
    """The class, not only the cases above: every (sub)parser a command builds is the one-line Parser."""
    parser, _ = cli.build_parser([command])
    parsers = list(_parsers(parser))
    assert len(parsers) > len(cli.COMMANDS)
    assert all(isinstance(p, cli.Parser) for p in parsers), [p.prog for p in parsers if not isinstance(p, cli.Parser)]


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["results", "export", "--help"]])
def test_help_still_prints_the_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: harness")


# ---------------------------------------------------------------- a stale torch-extension build lock


def _lock(root, *parts) -> str:
    folder = os.path.join(root, *parts)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "lock")
    os.close(os.open(path, os.O_CREAT | os.O_EXCL))  # what a FileBaton killed while building leaves
    return path


def test_a_stale_build_lock_is_removed_with_one_warning(tmp_path, monkeypatch):
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = _lock(str(tmp_path), "deepspeed_shm_comm")
    assert not FileBaton(stale).try_acquire()  # torch's builder would wait on it, forever
    lines = []
    assert build_lock.clear_stale(echo=lines.append) == [stale]
    assert not os.path.exists(stale)
    assert len(lines) == 1 and lines[0].startswith(f"warning: removed a stale torch extension build lock {stale} ")
    baton = FileBaton(stale)
    assert baton.try_acquire()  # the next build goes ahead
    baton.release()
    assert build_lock.clear_stale(echo=lines.append) == [] and len(lines) == 1  # nothing left to say


def test_a_held_build_lock_is_left_alone(tmp_path, monkeypatch):
    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    baton = FileBaton(str(folder / "lock"))
    assert baton.try_acquire()  # a live build, as torch holds it: the file open until released
    try:
        assert build_lock.holders(baton.lock_file_path) == [os.getpid()]
        assert build_lock.stale_locks() == []
        assert build_lock.clear_stale(echo=pytest.fail) == []
        assert os.path.exists(baton.lock_file_path)
    finally:
        baton.release()


def test_the_default_extensions_root_is_torchs(tmp_path, monkeypatch):
    """Without TORCH_EXTENSIONS_DIR, the lock torch's builder would wait on is found under its cache
    folder's tag (py311_cpu, ...), as torch decides that folder."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = _get_build_directory("deepspeed_shm_comm", verbose=False)
    assert folder.startswith(str(tmp_path))
    stale = _lock(folder)
    assert build_lock.build_locks() == [stale]
    assert build_lock.clear_stale(echo=lambda line: None) == [stale]


def test_a_run_is_launched_only_after_a_stale_lock_is_removed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    stale = _lock(str(tmp_path / "ext"), "deepspeed_shm_comm")

    class Launched(Exception):
        pass

    def popen(*args, **kwargs):
        assert not os.path.exists(stale)  # cleared before the launch
        raise Launched

    monkeypatch.setattr(supervise.subprocess, "Popen", popen)
    spec = {"workload": {"model": "tiny", "device": "cpu"}, "layout": {"engine": "deepspeed", "dp": 2}}
    with pytest.raises(Launched):
        run_spec_in(tmp_path, spec, 2, "deepspeed", 60)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: removed a stale torch extension build lock {stale} "), err


# ---------------------------------------------------------------- extensions per environment


def test_each_environment_builds_into_its_own_folder_unless_told(monkeypatch, tmp_path):
    """Two environments sharing torch's default folder rebuilt each other's DeepSpeed op at every run:
    a launched run (and harness train, under any launcher) gets a folder keyed by its environment;
    TORCH_EXTENSIONS_DIR, where set, stands."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    mine = build_lock.environment_dir()
    assert os.path.dirname(mine) == os.path.realpath(tmp_path / "torch_extensions")
    assert os.path.basename(mine).startswith(os.path.basename(os.path.realpath(sys.prefix)) + "-")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert build_lock.environment_dir() != mine  # another environment, another folder
    env = launch.run_env(2, {"workload": {"device": "cpu"}}, "tok", None)
    assert env["TORCH_EXTENSIONS_DIR"] == build_lock.environment_dir()
    given = launch.run_env(2, {"workload": {"device": "cpu"}}, "tok", {"TORCH_EXTENSIONS_DIR": "/x"})
    assert given["TORCH_EXTENSIONS_DIR"] == "/x"
    root, depth = build_lock.extensions_root()  # the stale-lock sweep still sees every environment's builds
    stale = _lock(os.path.join(mine, "deepspeed_shm_comm"))
    assert stale in build_lock.build_locks(root, depth)


# ---------------------------------------------------------------- what the README's commands leave behind


def _readme_commands() -> list[str]:
    lines = []
    for name in ("README.md", os.path.join("sweeps", "README.md")):
        with open(os.path.join(REPO, name)) as f:
            lines += [ln.strip() for ln in f if ln.strip().startswith(("harness ", "torchrun ", "deepspeed "))]
    return lines


def test_the_readmes_commands_write_no_committed_file():
    """Every `--out` of a README command goes where git ignores it (harness-out/), or to a file that
    is not in the checkout: `harness report --sweep cpu-demo --out reports/cpu-demo` rewrote the
    committed demo report."""
    outs = [(c, c.split("--out ", 1)[1].split()[0]) for c in _readme_commands() if "--out " in c]
    assert outs
    for command, out in outs:
        assert out.startswith("harness-out/") or not os.path.exists(os.path.join(REPO, out)), command


def test_the_default_stores_traces_are_ignored_like_the_store():
    """harness train with the default store (results.sqlite, ignored) keeps its traces in
    harness-traces/ beside it: ignored too, as harness-logs/ beside a store is."""
    with open(os.path.join(REPO, ".gitignore")) as f:
        ignored = {ln.strip() for ln in f}
    assert {"/results.sqlite", "harness-logs/", "harness-traces/"} <= ignored


# ---------------------------------------------------------------- one comparison per report

COMPARE = {
    "name": "c",
    "workload": {
        "model": "tiny",
        "seq_len": 32,
        "global_batch_size": 4,
        "steps": 5,
        "warmup_steps": 1,
        "device": "cpu",
    },
    "runs": [{"engine": "own", "dp": 2}],
}


def _fake_comparison(monkeypatch, ran: list):
    import harness.compare.orchestrate as orchestrate
    import harness.report.compare as report

    def run(cs, **kw):  # what the command prints its verdict from
        ran.append(cs.name)
        return {
            "name": cs.name,
            "verdict": "pass",
            "failed_runs": [],
            "fingerprints": {"same": True},
            "parity": {"verdict": "pass", "max_pairwise_rel_diff": 0.0, "tolerance": 1e-3, "runs": []},
        }

    monkeypatch.setattr(orchestrate, "run_comparison", run)
    monkeypatch.setattr(report, "write_report", lambda summary, out: {"markdown": "m", "html": "h"})


def test_a_second_comparison_into_the_same_report_is_refused_before_it_launches(no_launch, monkeypatch, one_line_error):
    from harness.compare.report_lock import report_lock

    (no_launch / "c.yaml").write_text(yaml.safe_dump(COMPARE))
    ran = []
    _fake_comparison(monkeypatch, ran)
    argv = ["compare", "c.yaml", "--out", "out", "--store", "r.sqlite"]
    with report_lock("out", "c") as lock:  # the first comparison, still running
        assert open(lock).read().strip() == str(os.getpid())
        line = one_line_error(cli.main(argv))
        assert (
            line == f"error: --out: comparison c is already running into out (pid {os.getpid()}); wait for "
            "it to end, or give another --out"
        )
        assert ran == []  # nothing launched
        # another comparison's report in the same folder has a lock of its own
        assert cli.main(["compare", "c.yaml", "--set", "name=d", "--out", "out", "--store", "r.sqlite"]) == 0
        assert ran == ["d"]
    assert not os.path.exists(lock)  # released and removed
    assert cli.main(argv) == 0  # free again: it runs
    assert ran == ["d", "c"] and not os.path.exists(lock)


# ---------------------------------------------------------------- Ctrl-C while harness imports

# A sitecustomize that stops the import of module $PAUSE_AT before it starts, says so on stderr and
# waits there: the test's SIGINT then always lands at that point of the import, however loaded the
# machine is (and an entry that never imports it ends with the spec's error, failing the test).
PAUSE_HOOK = """\
import os, sys, time
class _Pause:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["PAUSE_AT"]:
            sys.stderr.write("PAUSED " + name + "\\n")
            sys.stderr.flush()
            time.sleep(300)
sys.meta_path.insert(0, _Pause())
"""


def _console_script() -> str:
    """What pip's wrapper for the `harness` entry point runs (pyproject's [project.scripts])."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        module, func = tomllib.load(f)["project"]["scripts"]["harness"].split(":")
    return f"import re, sys\nfrom {module} import {func}\nsys.exit({func}())"


ENTRIES = {"python -m harness": ["-m", "harness"], "harness (console script)": ["-c", _console_script()]}
# Points of `harness compare`'s start: harness.cli itself (the console script's own import of it is
# Python's, before any harness code: not a point), its first imports, the command's module, then what
# the command imports: yaml, torch (seconds), inside torch, after torch.
POINTS = ["harness.cli", "argparse", "harness.commands.compare", "yaml", "torch", "torch.nn", "harness.report.compare"]
CASES = [(e, p) for e in ENTRIES for p in POINTS if not (p == "harness.cli" and "console" in e)]


@pytest.mark.slow
@pytest.mark.parametrize("entry, point", CASES, ids=[f"{e}@{p}" for e, p in CASES])
def test_ctrl_c_while_importing_exits_130_without_a_traceback(entry, point, tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(PAUSE_HOOK)
    env = {
        **os.environ,
        "PAUSE_AT": point,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), REPO, os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, *ENTRIES[entry], "compare", "no-such-spec.yaml"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # as in a terminal
    try:
        first = proc.stderr.readline()
        assert first == f"PAUSED {point}\n", first + proc.stderr.read()  # it got there, and waits
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and "Traceback" not in err, (proc.returncode, err)
    assert err.strip() in ("", "interrupted"), err


@pytest.mark.slow  # runs the CLI in a process, its stdout a pipe the reader closes early
def test_a_reader_that_stops_early_gets_no_traceback():
    """`harness plan ... | head`: the lines read are whole, and the command ends quietly (no
    BrokenPipeError traceback) with the shell's status for SIGPIPE."""
    cmd = [sys.executable, "-m", "harness.cli", "plan", "--model", "paper-13b", "--seq-len", "2048"]
    cmd += ["--global-batch-size", "2048", "--gpus", "64", "--hardware", "a100-80gb", "--format", "json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(100)  # megabytes follow: far more than a pipe holds, so the writer meets the close
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert first.startswith(b'[{"tp": ') and err == ""
