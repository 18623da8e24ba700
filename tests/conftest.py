import _posixsubprocess
import argparse
import multiprocessing.process
import os
import subprocess
import sys
import uuid

import pytest

pytest_plugins = ["pytester"]  # tests/test_process_guard.py runs the guard below in an inner session

# Tests run many small processes on 2 cores: one thread each unless a test says otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every run measures the best matmul rate for half a second (harness.measure.mfu), in this process and in each
# rank it launches; no test reads that figure's value, only that there is one: a twentieth of that is enough.
os.environ.setdefault("HARNESS_MATMUL_SECONDS", "0.025")

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


def start_cli(*args, **popen):
    """The real CLI started in the background (subprocess.Popen's keywords: cwd, env, stdout...)."""
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], **popen)


def profiled_record(spec: dict, step: float, parts: dict, world_size: int, tokens_per_s_per_device: float, **kw):
    """An ok record (new_record(spec, **kw)) whose profiler split its step of `step` ms into
    parts (compute, exposed_comm, ...), with no collectives."""
    from harness.store import new_record

    rec = new_record(spec, **kw)
    rec.update(
        status="ok",
        fingerprint={"world_size": world_size},
        metrics={
            "step_time_s": {"median": step / 1e3, "ci95_low": step / 1e3, "ci95_high": step / 1e3, "n": 4},
            "tokens_per_s_per_device": tokens_per_s_per_device,
            "breakdown_ms": {**parts, "step": step},
            "breakdown_source": "profiler",
            "collectives": [],
        },
    )
    return rec


def megatron_parser(**parser_kw) -> argparse.ArgumentParser:
    """Megatron-LM's own argument parser, strictly: every option of add_megatron_arguments() in
    megatron/training/arguments.py at the commit tests/data/megatron_lm_arguments.json names (dumped
    from the parser that function builds, as name, dest, action, nargs, type, choices), and no other.
    Megatron-LM's training package is not in the megatron-core wheel installed here."""
    import json
    import pathlib
    from collections import defaultdict

    table = json.loads((pathlib.Path(__file__).parent / "data" / "megatron_lm_arguments.json").read_text())
    p = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False, **parser_kw)
    actions = defaultdict(list)
    for flag, entry in table["options"].items():
        actions[json.dumps(entry)].append(flag)
    types = {"int": int, "float": float, "str": str, None: None}
    for key, flags in actions.items():
        dest, kind, nargs, typ, choices = json.loads(key)
        if kind == "true":
            p.add_argument(*flags, dest=dest, action="store_true")
        elif kind == "false":
            p.add_argument(*flags, dest=dest, action="store_false")
        elif kind == "bool":  # argparse adds the --no- form itself
            flags = [f for f in flags if not any(f == "--no-" + g[2:] for g in flags)]
            p.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction)
        else:
            p.add_argument(*flags, dest=dest, type=types[typ], nargs=nargs, choices=choices)
    return p


def assert_case_matches_reference(per_rank: list, world: int, index: int, case: dict, ref_losses, ref_state):
    """Rank 0's result of an equivalence case (harness.testing.equivalence) against the single-device
    reference: its losses within the case's rtol (1e-5 unless it says), then losses and final weights
    within its weights_rtol (rtol unless it says); and every rank reports rank 0's losses."""
    from harness.testing.reference import mismatches

    result = per_rank[0][index]
    rtol = case.get("rtol", 1e-5)
    bad = mismatches({"losses": result["losses"]}, ref_losses, None, rtol)
    bad += mismatches(result, ref_losses, ref_state, case.get("weights_rtol", rtol))
    assert not bad, "\n".join(bad)
    for r in range(world):  # every rank reports the same global loss
        assert per_rank[r][index]["losses"] == result["losses"], f"rank {r}"


# run_sweep's keywords for a sweep run from this process: the direct launcher, 60 s a point, no progress line
IN_PROCESS_SWEEP = dict(launcher="direct", timeout_s=60, progress=False)


def ok_run_spec(seen: list, keyword: str = "point_key"):
    """A stand-in for harness.launch.run_spec that starts nothing: it appends the keyword it is
    called with (point_key, log_dir...) to `seen` and writes the ok record a finished run writes."""
    from harness.store import ResultsStore, new_record

    def run_spec(spec, *, store_path, sweep, point_key, **kw):
        seen.append({"point_key": point_key, **kw}[keyword])
        rec = new_record(spec, sweep=sweep, point_key=point_key)
        rec["status"] = "ok"
        ResultsStore(store_path).write(rec)
        return rec

    return run_spec


def run_spec_in(folder, spec: dict, nproc: int, launcher: str, timeout_s: float, **kw) -> dict:
    """harness.launch.run_spec with its store (r.sqlite) and its logs (logs/) in folder."""
    from harness import launch

    store, logs = str(folder / "r.sqlite"), str(folder / "logs")
    return launch.run_spec(
        spec, nproc=nproc, launcher=launcher, store_path=store, timeout_s=timeout_s, log_dir=logs, **kw
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
        return run_cli(*args, cwd=tmp_path, env={"HARNESS_TEST_TAG": tag, **(env or {})}, timeout=timeout)

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


def pytest_collection_finish(session):
    """The shared launches (harness.testing.launches) run only the jobs the selected tests use."""
    from harness.testing import launches

    launches.select(session.items)


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
