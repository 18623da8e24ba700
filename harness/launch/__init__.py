"""Launch one run as its own process tree, enforce a timeout, and classify the outcome.

Why this module exists: a sweep of hundreds of layouts only survives if every run is fenced
off. Each run gets its own session (process group), a unique token in its environment and
a deadline. When it ends - normally, by crash, or by timeout - every process that carries
its token is terminated (SIGTERM, then SIGKILL) and the absence of survivors is verified:
torchrun starts its workers in sessions of their own, so killing the process group alone
would leave ranks behind. Success is judged from the record the runner wrote, never from
the exit code (DeepSpeed launches sometimes abort at exit after finishing). Where no record
exists, one is written here: timeout, oom (CUDA out-of-memory seen in the output) or failed
with the last lines of output; a failed run's record names the rank that failed first and how
(first_failure), ahead of its peers' echoes.

`python -m harness.launch MODULE ARGS...` runs MODULE (the deepspeed launcher's runner) so that
every process it starts dies with it (fenced): a killed sweep leaves no launcher or rank behind.

The fencing is processes.py, the outcome outcome.py, the stale build locks build_lock.py; this
module builds the command, starts the run and waits for it.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import tempfile
import time

import yaml

from harness.errors import SpecError
from harness.launch.build_lock import clear_stale as clear_stale_build_locks
from harness.launch.build_lock import use_environment_dir
from harness.launch.outcome import (
    TAIL_LINES,
    classify_output,
    error_excerpt,
    first_error_line,
    first_failure,
    first_failure_line,
    lead_with_error_line,
    tail,
)
from harness.launch.processes import (
    FENCE_MODULE,
    RANK_EXIT,
    SWEEP_ID_ENV,
    SWEEP_PID_ENV,
    TOKEN_ENV,
    fenced,
    kill_run,
    processes_with_env,
    reap_orphans_of_dead_sweeps,
    set_parent_death_signal,
    terminate,
)
from harness.launch.relay import LogRelay
from harness.store import ResultsStore, new_record, now_iso

__all__ = [
    "TAIL_LINES",
    "RANK_EXIT",
    "FENCE_MODULE",
    "SWEEP_ID_ENV",
    "SWEEP_PID_ENV",
    "TOKEN_ENV",
    "classify_output",
    "error_excerpt",
    "fenced",
    "first_error_line",
    "first_failure",
    "first_failure_line",
    "kill_run",
    "lead_with_error_line",
    "processes_with_env",
    "reap_orphans_of_dead_sweeps",
    "tail",
    "terminate",
]

LAUNCHERS = ("torchrun", "deepspeed", "direct", "srun")
LOCAL_LAUNCHERS = ("torchrun", "deepspeed", "direct")  # start every rank on this machine
LINGER_S = 15.0  # seconds a run may take to exit after its record is written


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now; the launcher binds it a moment later (tiny race, accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_launcher(launcher: str, nproc: int, nnodes: int = 1, field: str = "launcher") -> None:
    """Whether `launcher` can start `nproc` processes on each of `nnodes` nodes: a SpecError line
    if not. Commands call it for every run before the first launch; build_command calls it too."""
    if launcher not in LAUNCHERS:
        raise SpecError(field, f"{launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if not all(isinstance(n, int) and n >= 1 for n in (nproc, nnodes)):
        raise SpecError(field, f"needs a positive process and node count, got {nproc!r} and {nnodes!r}")
    if launcher == "direct" and nproc * nnodes != 1:
        raise SpecError(field, f"direct starts one process; this run needs {nproc * nnodes}: use torchrun or deepspeed")


def build_command(
    launcher: str,
    nproc: int,
    argv: list[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    module: str = "harness.cli",
) -> list[str]:
    """The command line that starts `python -m <module> <argv>` on `nproc` ranks per node.

    `argv` are the harness CLI arguments (e.g. ["train", "spec.yaml", "--store", ...]).
    The deepspeed launcher is run as `python -m deepspeed.launcher.runner` (what the
    `deepspeed` script does) so that it uses this interpreter; `--num_gpus` is accepted on a
    CPU-only machine too, where it is the number of CPU ranks.
    """
    check_launcher(launcher, nproc, nnodes)
    port = master_port or free_port()
    py = sys.executable
    if launcher == "direct":
        return [py, "-m", module, *argv]
    if launcher == "torchrun":
        return [
            py,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            f"--master_addr={master_addr}",
            f"--master_port={port}",
            "-m",
            module,
            *argv,
        ]
    if launcher == "deepspeed":
        cmd = [
            py,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(nproc),
            "--master_addr",
            master_addr,
            "--master_port",
            str(port),
        ]
        if nnodes > 1:  # one launcher per node, started by the caller (e.g. srun), no ssh
            cmd += ["--num_nodes", str(nnodes), "--node_rank", str(node_rank), "--no_ssh"]
        return cmd + ["--module", module, *argv]
    # srun: one task per rank; the runner maps SLURM_PROCID etc. itself
    return ["srun", f"--nodes={nnodes}", f"--ntasks-per-node={nproc}", "--kill-on-bad-exit=1", py, "-m", module, *argv]


# ---------------------------------------------------------------- one run

_CUDA_CACHE: list[bool] = []


def _has_cuda() -> bool:
    if not _CUDA_CACHE:
        try:
            import torch

            _CUDA_CACHE.append(bool(torch.cuda.is_available()))
        except Exception:  # noqa: BLE001 - no torch means no CUDA here
            _CUDA_CACHE.append(False)
    return _CUDA_CACHE[0]


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a Slurm allocation), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_process(nproc: int) -> int:
    """OMP_NUM_THREADS for each of `nproc` ranks sharing this machine's cores."""
    return max(1, cpu_cores() // max(1, nproc))


def run_env(nproc: int, spec_dict: dict, token: str, extra_env: dict | None) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    env[TOKEN_ENV] = token
    env.setdefault("PYTHONUNBUFFERED", "1")
    use_environment_dir(env)  # this environment's torch extensions: another's would be rebuilt at every run
    device = (spec_dict.get("workload") or {}).get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not _has_cuda())
    if on_cpu and "OMP_NUM_THREADS" not in env:
        # the deepspeed launcher leaves it unset and torchrun sets 1: both are wrong on CPU
        env["OMP_NUM_THREADS"] = str(threads_per_process(nproc))
    return env


def _spec_dict(spec) -> dict:
    return spec if isinstance(spec, dict) else spec.to_dict()


def recorded_command(cmd: list[str]) -> list[str]:
    """A launch command as a record keeps it: this interpreter by its name, not its path on this
    machine (the fingerprint names the Python version; the run's log starts with the full line)."""
    return ["python", *cmd[1:]] if cmd and cmd[0] == sys.executable else list(cmd)


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
    cmd = build_command(launcher, nproc, argv, nnodes=nnodes, module=module)
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
