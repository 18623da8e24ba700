import os
import subprocess
import sys

import pytest

# Tests run many small processes on 2 cores: one thread each unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, cwd=None, env=None, timeout=300):
    """The real CLI, as a user runs it (python -m harness.cli == the `harness` script)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


def pytest_collection_modifyitems(config, items):
    """A test that runs the CLI or a launcher starts processes: it belongs to the slow tier,
    marked or not (`fake` is test_launch's stand-in runner, started by the real launchers)."""
    for item in items:
        if {"cli", "fake"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
