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
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import yaml

from harness.errors import SpecError
from harness.frameworks.build_lock import clear_stale as clear_stale_build_locks
from harness.store import ResultsStore, mentions_oom, new_record, now_iso

LAUNCHERS = ("torchrun", "deepspeed", "direct", "srun")
LOCAL_LAUNCHERS = ("torchrun", "deepspeed", "direct")  # start every rank on this machine
TOKEN_ENV = "HARNESS_RUN_TOKEN"
SWEEP_PID_ENV = "HARNESS_SWEEP_PID"
SWEEP_ID_ENV = "HARNESS_SWEEP_ID"
TAIL_LINES = 30
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


def build_command(launcher: str, nproc: int, argv: list[str], *, nnodes: int = 1, node_rank: int = 0,
                  master_addr: str = "127.0.0.1", master_port: int | None = None,
                  module: str = "harness.cli") -> list[str]:
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
        return [py, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
                f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={port}",
                "-m", module, *argv]
    if launcher == "deepspeed":
        cmd = [py, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc),
               "--master_addr", master_addr, "--master_port", str(port)]
        if nnodes > 1:  # one launcher per node, started by the caller (e.g. srun), no ssh
            cmd += ["--num_nodes", str(nnodes), "--node_rank", str(node_rank), "--no_ssh"]
        return cmd + ["--module", module, *argv]
    # srun: one task per rank; the runner maps SLURM_PROCID etc. itself
    return ["srun", f"--nodes={nnodes}", f"--ntasks-per-node={nproc}", "--kill-on-bad-exit=1",
            py, "-m", module, *argv]


# ---------------------------------------------------------------- process trees

def _set_parent_death_signal(parent: int | None = None) -> None:
    """In the child before exec: get SIGTERM if the process that started it (`parent`) dies,
    even by SIGKILL; exit at once if it already died between fork and this call.

    torchrun forwards SIGTERM to its ranks; the deepspeed launcher's runner does not, so it runs
    fenced (fenced()). A killed sweep thus does not leave a run training on its own. Linux only;
    elsewhere a no-op.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)


FENCE_MODULE = "harness.launch"
RANK_EXIT = re.compile(r"^harness\.launch: local rank (\d+) \(pid \d+\) exited with code (-?\d+)$", re.M)


def _report_exit(pid: int, rank: str) -> None:
    """Wait (without reaping: its parent still collects it) for a rank to end; print how it
    ended unless it succeeded. The first such line names the rank that failed first."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return
    code = -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status
    if code:
        print(f"harness.launch: local rank {rank} (pid {pid}) exited with code {code}", file=sys.stderr, flush=True)


def fenced(argv: list[str]) -> None:
    """Run module argv[0] as __main__ (with argv[1:]) so that every process it starts gets
    SIGTERM when it dies. On one node the deepspeed launcher's runner installs no signal handler
    and its child, the per-node launcher (deepspeed.launcher.launch), is not told when the runner
    dies: killed, it would leave that launcher and the ranks running. Fenced, the runner's death
    reaches the launcher (started fenced as well), whose SIGTERM handler ends the ranks; and the
    launcher prints, in order, how each rank that failed ended (RANK_EXIT), which it does not."""
    import runpy
    import threading

    class FencedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            if kwargs.get("preexec_fn") is None:
                kwargs["preexec_fn"] = functools.partial(_set_parent_death_signal, os.getpid())
            cmd = [str(a) for a in args] if isinstance(args, (list, tuple)) else []
            if "deepspeed.launcher.launch" in cmd:
                cmd.insert(cmd.index("deepspeed.launcher.launch"), FENCE_MODULE)
                args = cmd
            super().__init__(args, *rest, **kwargs)
            rank = next((a.split("=", 1)[1] for a in cmd if a.startswith("--local_rank=")), None)
            if rank is not None:
                threading.Thread(target=_report_exit, args=(self.pid, rank), daemon=True).start()

    subprocess.Popen = FencedPopen
    sys.argv = list(argv)
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


def processes_with_env(name: str, value: str | None = None) -> list[psutil.Process]:
    """Live processes of this user whose environment has `name` (= `value` if given).

    Environment variables are inherited by every descendant, also by ranks that a launcher
    moved into a session of their own or that were re-parented to init: this finds them all.
    """
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            env = p.environ()
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.Error, OSError):
            continue
        if name in env and (value is None or env[name] == value):
            found.append(p)
    return found


def terminate(procs: list[psutil.Process], grace_s: float = 5.0) -> list[psutil.Process]:
    """SIGTERM, wait `grace_s`, SIGKILL the rest; returns the processes still alive after."""
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return alive


def kill_run(popen: subprocess.Popen, token: str, grace_s: float = 5.0) -> list[int]:
    """Kill everything that belongs to one run: its session and every carrier of its token.

    Returns the PIDs that survived SIGKILL (only a process stuck in the kernel can): they are
    reported in the record rather than stopping the sweep.
    """
    pgid = popen.pid  # start_new_session: the launcher leads its own group
    try:
        procs = [psutil.Process(popen.pid)] + psutil.Process(popen.pid).children(recursive=True)
    except psutil.Error:
        procs = []
    seen = {p.pid for p in procs}
    procs += [p for p in processes_with_env(TOKEN_ENV, token) if p.pid not in seen]
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    alive = terminate(procs, grace_s)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    # processes that appeared while we were killing (a launcher restarting a rank)
    alive += processes_with_env(TOKEN_ENV, token)
    return [p.pid for p in terminate(alive, 1.0)]


def reap_orphans_of_dead_sweeps(sweep_id: str) -> int:
    """Kill runs left by an earlier sweep process of `sweep_id` that died (e.g. SIGKILL).

    Returns how many processes were killed.
    """
    victims = []
    for p in processes_with_env(SWEEP_ID_ENV, sweep_id):
        try:
            owner = int(p.environ().get(SWEEP_PID_ENV, "0"))
        except (psutil.Error, ValueError):
            continue
        if owner != os.getpid() and not psutil.pid_exists(owner):
            victims.append(p)
    terminate(victims, 3.0)
    return len(victims)


# ---------------------------------------------------------------- outcome

def tail(path: str, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200_000))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def classify_output(text: str, timed_out: bool) -> str:
    """Status of a run that wrote no record, from what it printed."""
    if timed_out:
        return "timeout"
    if mentions_oom(text):
        return "oom"
    return "failed"


ERROR_LINE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*|\d+:\s*)?(error: .*\S)\s*$", re.M)


def first_error_line(text: str | None) -> str:
    """The first `error: <field>: <reason>` line a run printed (a refusal by its preflight, a
    user mistake: harness.cli prints it and exits 2), '' if none; a launcher's rank prefix
    (`[rank0]: `, `0: `) is dropped. This is the cause; the launcher's `exitcode: 2` is not."""
    found = ERROR_LINE.search(text or "")
    return found[1][:500] if found else ""


def lead_with_error_line(record: dict, output: str) -> None:
    """A failed run's record: `error_line` is the first `error:` line of its output, and its
    error starts with that line (every view shows the error's first line)."""
    if record.get("status") == "ok":
        return
    line = first_error_line(output) or first_error_line(record.get("error"))
    if not line:
        return
    record["error_line"] = line
    error = record.get("error") or ""
    if not error.startswith(line):
        record["error"] = line + ("\n---\n" + error if error else "")


def error_excerpt(text: str) -> str:
    """The lines that explain a failure: the last exception line first, then the tail."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|Exception|exitcode|Signal|Killed)", ln)]
    head = errs[-1].strip() if errs else ""
    body = "\n".join(lines[-TAIL_LINES:])
    return (head + "\n---\n" + body) if head else body


def _how(code: int) -> str:
    """An exit status in words: 'killed by SIGKILL (exit code -9)', 'exit code 137 (128 + SIGKILL)'."""
    try:
        if code < 0:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        if code > 128:
            return f"exit code {code} (128 + {signal.Signals(code - 128).name})"
    except ValueError:
        pass
    return f"exit code {code}"


def first_failure(record: dict, output: str) -> dict | None:
    """The rank that failed first and how: its own report in the record (an exception or an
    out-of-memory error that is not the echo of a peer's), else what the launcher saw: torchrun's
    root cause, or the first rank exit the fenced deepspeed launcher printed (RANK_EXIT); a rank
    killed by a signal cannot report, its peers' lost connections are only echoes of it."""
    own = [f for f in record.get("rank_failures") or [] if not f.get("echo")]
    if own:
        return {"rank": own[0]["rank"], "how": "out of memory" if own[0]["status"] == "oom" else own[0]["error"],
                "source": "rank"}
    root = output.rsplit("Root Cause (first observed failure):", 1)
    found = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", root[1], re.S) if len(root) == 2 else None
    source = "torchrun"
    if found is None:
        found, source = RANK_EXIT.search(output), "deepspeed launcher"
    if found is None:
        return None
    return {"rank": int(found[1]), "exit_code": int(found[2]), "how": _how(int(found[2])), "source": source}


def first_failure_line(cause: dict) -> str:
    return (f"rank {cause['rank']} failed first: {cause['how']}, per {cause['source']}; "
            "the errors of its peers below are echoes of it")


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


def run_spec(spec, *, nproc: int, launcher: str, store_path: str, timeout_s: float,
             sweep: str | None = None, point_key: str | None = None, extra_env: dict | None = None,
             log_dir: str | None = None, nnodes: int = 1, module: str = "harness.cli",
             run_id: str | None = None) -> dict:
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
    except OSError as e:
        raise SpecError("logs", f"cannot write the run's files in {log_dir}: {e}") from None

    start = time.monotonic()
    timed_out, lingered, survivors = False, 0.0, []
    with log:
        popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env, start_new_session=True,
                                 preexec_fn=functools.partial(_set_parent_death_signal, os.getpid()))
        try:
            timed_out, lingered = _wait(popen, store, run_id, timeout_s)
        finally:  # also on KeyboardInterrupt: never leave a run behind
            survivors = kill_run(popen, run_id)
    wall = time.monotonic() - start
    output = tail(log_path, 400)

    found = store.get(run_id)
    if found is not None:  # the runner's verdict stands, also if its processes then hung
        record = found
        if lingered:
            record["error"] = (record.get("error") or "") + \
                f"\n(processes did not exit {lingered:g} s after the record was written; killed)"
    else:
        record["status"] = classify_output(output, timed_out)
        if timed_out:
            record["error"] = f"timed out after {timeout_s:g} s; last output:\n" + "\n".join(
                output.splitlines()[-TAIL_LINES:])
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
    record["launch"] = {"launcher": launcher, "nproc": nproc, "nnodes": nnodes, "command": recorded_command(cmd),
                        "exit_code": popen.returncode, "wall_s": round(wall, 3), "log": log_path,
                        "timeout_s": timeout_s, "timed_out": timed_out}
    if survivors:
        record["launch"]["survivors"] = survivors
    if record["status"] != "ok":  # what the launcher saw (e.g. which rank died by which signal)
        record["launch"]["output_tail"] = "\n".join(output.splitlines()[-TAIL_LINES:])
    store.write(record)
    return record


def _wait(popen: subprocess.Popen, store: ResultsStore, run_id: str, timeout_s: float,
          grace_s: float | None = None, poll_s: float = 1.0) -> tuple[bool, float]:
    """Wait for the run to exit; returns (timed_out, lingered seconds granted after a record).

    A run whose record is already written is over even if its processes are not: a rank that
    raised may leave its peers blocked in a collective (and itself in teardown) until gloo's
    or NCCL's 30-minute timeout. So once the record exists, the processes get `grace_s` to
    exit and are then killed; this keeps a sweep of mostly-OOM points from stalling.
    """
    grace_s = LINGER_S if grace_s is None else grace_s
    deadline = time.monotonic() + timeout_s
    linger_until = None
    while True:
        try:
            popen.wait(timeout=poll_s)
            return False, 0.0
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if linger_until is None and store.get(run_id) is not None:
            linger_until = now + grace_s
        if linger_until is not None and now >= linger_until:
            return False, grace_s
        if now >= deadline:
            return True, 0.0


if __name__ == "__main__":  # python -m harness.launch MODULE ARGS...
    fenced(sys.argv[1:])
