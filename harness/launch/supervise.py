"""One run from start to record: write its spec and log, start its process tree, wait for its record or its
deadline, kill what is left (processes.kill_run), and judge the outcome from the record the runner wrote,
else from the output (outcome.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import time

import yaml

from harness.errors import SpecError
from harness.launch.build_lock import clear_stale as clear_stale_build_locks
from harness.launch.command import build_command, free_port, recorded_command
from harness.launch.environment import run_env
from harness.launch.outcome import (
    TAIL_LINES,
    classify_output,
    error_excerpt,
    first_failure,
    first_failure_line,
    lead_with_error_line,
    tail,
)
from harness.launch.processes import FENCE_MODULE, kill_run, set_parent_death_signal
from harness.launch.relay import LogRelay
from harness.store import ResultsStore, new_record, now_iso

LINGER_S = 15.0  # seconds a run may take to exit after its record is written


def _spec_dict(spec) -> dict:
    return spec if isinstance(spec, dict) else spec.to_dict()


def run_spec(
    spec,
    *,
    nproc: int,
    launcher: str,
    store_path: str,
    timeout_s: float,
    sweep: str | None = None,
    point_key: str | None = None,
    extra_env: dict | None = None,
    log_dir: str | None = None,
    nnodes: int = 1,
    module: str = "harness.cli",
    run_id: str | None = None,
) -> dict:
    """Run one spec to completion or timeout and return its record (always one).

    The record is the runner's (looked up by run_id) or, if it wrote none, one written here.
    Either way it gets a `launch` section: command, exit code, wall time, log path.
    """
    spec_dict = _spec_dict(spec)
    record = new_record(spec_dict, sweep=sweep, point_key=point_key)
    if run_id:
        record["run_id"] = run_id
    run_id = record["run_id"]
    log_dir = log_dir or tempfile.mkdtemp(prefix="harness-logs-")
    spec_path = os.path.join(log_dir, f"{run_id}.yaml")
    log_path = os.path.join(log_dir, f"{run_id}.log")
    # paths as given (relative stays relative): the ranks start in this working directory
    argv = ["train", spec_path, "--store", store_path, "--run-id", run_id]
    if sweep is not None:
        argv += ["--sweep", sweep]
    if point_key is not None:
        argv += ["--point-key", point_key]
    port = free_port()
    cmd = build_command(launcher, nproc, argv, nnodes=nnodes, module=module, master_port=port)
    if launcher == "deepspeed":  # its runner does not pass its own death on: run it fenced
        cmd[2:2] = [FENCE_MODULE]
    env = run_env(nproc, spec_dict, run_id, extra_env)
    clear_stale_build_locks()  # one that a killed build left would hang every DeepSpeed run until its timeout
    store = ResultsStore(store_path)
    try:  # a full disk or a read-only log folder stops here, before anything starts
        os.makedirs(log_dir, exist_ok=True)
        with open(spec_path, "w") as f:
            yaml.safe_dump(spec_dict, f, sort_keys=False)
        log = open(log_path, "wb")
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        relay = LogRelay(log_path, offset=log.tell())  # the run's `note:` lines, on this console
    except OSError as e:
        raise SpecError("logs", f"cannot write the run's files in {log_dir}: {e}") from None

    start = time.monotonic()
    timed_out, lingered, survivors = False, 0.0, []
    with log:
        popen = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=functools.partial(set_parent_death_signal, os.getpid()),
        )
        try:
            timed_out, lingered = _wait(popen, store, run_id, timeout_s, relay=relay.poll)
        finally:  # also on KeyboardInterrupt: never leave a run behind
            survivors = kill_run(popen, run_id)
            if not survivors:  # what its killed ranks could not unlink (harness.runtime.teardown)
                from harness.runtime import remove_deepspeed_shm_buffers  # torch: imported once a run ends

                remove_deepspeed_shm_buffers("127.0.0.1", port)
    wall = time.monotonic() - start
    output = tail(log_path, 400)

    found = store.get(run_id)
    if found is not None:  # the runner's verdict stands, also if its processes then hung
        record = found
        if lingered:
            record["error"] = (
                record.get("error") or ""
            ) + f"\n(processes did not exit {lingered:g} s after the record was written; killed)"
    else:
        record["status"] = classify_output(output, timed_out)
        if timed_out:
            record["error"] = f"timed out after {timeout_s:g} s; last output:\n" + "\n".join(
                output.splitlines()[-TAIL_LINES:]
            )
        elif not record.get("error"):
            record["error"] = error_excerpt(output) or f"exit code {popen.returncode}, no output"
        record["ended_at"] = now_iso()
    # a diverged run is the runner's verdict, every rank's exit code 1 its echo: no rank failed first
    judged = record["status"] == "ok" or record.get("diverged_at_step") is not None
    cause = None if judged or timed_out else first_failure(record, output)
    if cause is not None:
        record["first_failure"] = cause
        if cause["source"] != "rank":  # a rank's own report already leads the error
            record["error"] = first_failure_line(cause) + "\n---\n" + (record.get("error") or "")
    lead_with_error_line(record, output)
    record["launch"] = {
        "launcher": launcher,
        "nproc": nproc,
        "nnodes": nnodes,
        "command": recorded_command(cmd),
        "exit_code": popen.returncode,
        "wall_s": round(wall, 3),
        "log": log_path,
        "timeout_s": timeout_s,
        "timed_out": timed_out,
    }
    if survivors:
        record["launch"]["survivors"] = survivors
    if record["status"] != "ok":  # what the launcher saw (e.g. which rank died by which signal)
        record["launch"]["output_tail"] = "\n".join(output.splitlines()[-TAIL_LINES:])
    store.write(record)
    return record


def _wait(
    popen: subprocess.Popen,
    store: ResultsStore,
    run_id: str,
    timeout_s: float,
    grace_s: float | None = None,
    poll_s: float = 1.0,
    relay=None,
) -> tuple[bool, float]:
    """Wait for the run to exit; returns (timed_out, lingered seconds granted after a record).

    A run whose record is already written is over even if its processes are not: a rank that
    raised may leave its peers blocked in a collective (and itself in teardown) until gloo's
    or NCCL's 30-minute timeout. So once the record exists, the processes get `grace_s` to
    exit and are then killed; this keeps a sweep of mostly-OOM points from stalling. `relay` is
    called at every poll, and once at the end (LogRelay.poll: the run's notes to the console).
    """
    grace_s = LINGER_S if grace_s is None else grace_s
    deadline = time.monotonic() + timeout_s
    linger_until = None
    relay = relay or (lambda: None)
    while True:
        try:
            popen.wait(timeout=poll_s)
            relay()
            return False, 0.0
        except subprocess.TimeoutExpired:
            relay()
        now = time.monotonic()
        if linger_until is None and store.get(run_id) is not None:
            linger_until = now + grace_s
        if linger_until is not None and now >= linger_until:
            return False, grace_s
        if now >= deadline:
            return True, 0.0
