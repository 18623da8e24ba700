import _posixsubprocess
import multiprocessing.process
import os
import subprocess
import sys
import uuid

import pytest

pytest_plugins = ["pytester"]  # tests/test_process_guard.py runs the guard below in an inner session

# Tests run many small processes on 2 cores: one thread each unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def heavy_imports_after(code: str) -> list[str]:
    """The torch, transformers and DeepSpeed modules a fresh interpreter holds after running `code`
    (which must succeed): what a light path (planning, reading engine facts) must leave empty."""
    probe = (
        code + "\nimport sys\nprint('heavy:', *sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('torch', 'transformers', 'deepspeed')))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()[-1].split()[1:]  # the probe's line comes last


def run_cli(*args, cwd=None, env=None, timeout=300):
    """The real CLI, as a user runs it (python -m harness.cli == the `harness` script)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def tagged(tmp_path):
    """The real CLI in tmp_path with a tag in its environment that every process it starts
    inherits: after a refused input no process carrying it may exist (nothing launched)."""
    from harness import launch

    tag = uuid.uuid4().hex

    def run(*args, env=None, timeout=300):
        out = subprocess.run(
            [sys.executable, "-m", "harness.cli", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "HARNESS_TEST_TAG": tag, **(env or {})},
        )
        return out

    run.alive = lambda: launch.processes_with_env("HARNESS_TEST_TAG", tag)
    return run


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """Run in tmp_path, in-process; a quick test's process start fails it (the guard below)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def one_line_error(capsys):
    """check(rc) -> the one line a refused input prints: exit code 2, one stderr line `error: ...`,
    no traceback."""

    def check(rc: int) -> str:
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (rc, captured.err, captured.out[-500:])
        assert "Traceback" not in captured.err
        return lines[0]

    return check


# Fixtures that start processes: a test using one belongs to the slow tier, marked or not (`fake`
# is test_launch's stand-in runner, started by the real launchers).
STARTS_PROCESSES = {"cli", "tagged", "fake"}


@pytest.fixture
def drawn(monkeypatch):
    """Every report figure drawn, as (plots function, matplotlib Figure), kept open for inspection."""
    from harness.report import plots

    seen = []
    real = plots._encode

    def keep(fig):
        seen.append((sys._getframe(1).f_code.co_name, fig))
        return real(fig)

    monkeypatch.setattr(plots, "_encode", keep)
    return seen


def pytest_collection_modifyitems(config, items):
    for item in items:
        if STARTS_PROCESSES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------- the quick tier starts no process
#
# While a test not marked slow runs (its setup, call and teardown), every way of starting a process
# is replaced by a refusal that fails the test and names the way, so a quick test that starts one
# cannot pass unnoticed. The refusal raises pytest's Failed, a BaseException, which `except
# Exception` does not swallow; a test that swallows even that still fails, from its report.

PROCESS_STARTS = [  # (owner, attribute, what a failure calls it)
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),  # run, call, check_output, os.popen, asyncio
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),  # multiprocessing's spawn and forkserver
    (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),  # torch.multiprocessing, pools
    (os, "fork", "os.fork"),  # also os.spawn*, pty.fork
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
]
_REFUSED = pytest.StashKey[list]()


def _refusal(item, what):
    def refuse(*args, **kwargs):
        item.stash[_REFUSED].append(what)
        pytest.fail(
            f"{item.nodeid} starts a process ({what}) in the quick tier: mark it "
            "@pytest.mark.slow, or keep the process out of it",
            pytrace=True,
        )

    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("slow"):
        yield
        return
    item.stash[_REFUSED] = []
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, what in PROCESS_STARTS:
            if hasattr(owner, name):
                mp.setattr(owner, name, _refusal(item, what))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    refused = item.stash.get(_REFUSED, [])
    item.stash[_REFUSED] = []  # each refusal fails one phase (setup, call or teardown)
    if refused and report.passed:  # the code under test caught the refusal
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} starts a process ({refused[0]}) in the quick tier and caught the refusal"
