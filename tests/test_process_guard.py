"""The quick tier starts no process: tests/conftest.py fails a test not marked slow that starts one,
whichever way it starts it, even when the test catches the failure; a slow test is left alone.

Shown in an inner pytest session (in this process) that runs with a copy of tests/conftest.py."""

import pathlib

CONFTEST = (pathlib.Path(__file__).parent / "conftest.py").read_text()

INNER = """
import multiprocessing
import multiprocessing.util
import os
import subprocess

import pytest

STARTS = ("fork", "system", "posix_spawn")
BEFORE = {name: getattr(os, name) for name in STARTS}  # at collection: no test runs, the inner guard is off


def test_subprocess_run():
    subprocess.run(["true"])


def test_os_system():
    os.system("true")


def test_os_fork():
    os.fork()


def test_os_posix_spawn():
    os.posix_spawn("/bin/true", ["true"], dict(os.environ))


def test_multiprocessing_spawn():
    multiprocessing.get_context("spawn").Process(target=print).start()


def test_fork_exec():
    multiprocessing.util.spawnv_passfds("/bin/true", ["true"], ())


def test_caught():
    try:
        subprocess.check_output(["true"])
    except BaseException:
        pass


def test_quick_without_a_process_passes_and_is_guarded():
    assert all(getattr(os, name) is not BEFORE[name] for name in STARTS)


@pytest.mark.slow
def test_slow_is_left_alone():
    assert {name: getattr(os, name) for name in STARTS} == BEFORE
"""

REFUSED = {  # inner test -> how the failure names the start
    "test_subprocess_run": "subprocess.Popen",
    "test_os_system": "os.system",
    "test_os_fork": "os.fork",
    "test_os_posix_spawn": "os.posix_spawn",
    "test_multiprocessing_spawn": "multiprocessing Process.start",
    "test_fork_exec": "_posixsubprocess.fork_exec",
}


def test_a_quick_test_that_starts_a_process_fails_and_a_slow_one_may(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # installed plugins may start processes themselves
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    result.assert_outcomes(passed=2, failed=len(REFUSED) + 1)
    result.stdout.fnmatch_lines_random(
        [
            f"*test_inner.py::{name} starts a process ({what}) in the quick tier: mark it @pytest.mark.slow*"
            for name, what in REFUSED.items()
        ]
        + ["*test_inner.py::test_caught starts a process (subprocess.Popen) in the quick tier and caught the refusal*"]
    )
