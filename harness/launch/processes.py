"""Fencing a run off: every process a run starts carries its token and dies with it.

torchrun starts its workers in sessions of their own and the deepspeed launcher's runner
forwards no signal, so killing a process group alone would leave ranks behind: a run's
processes are found by the token in their environment, terminated (SIGTERM, then SIGKILL) and
their absence verified; `python -m harness.launch MODULE ARGS...` (fenced) runs the deepspeed
launcher's runner so that every process it starts gets SIGTERM when it dies.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import signal
import subprocess
import sys

import psutil

TOKEN_ENV = "HARNESS_RUN_TOKEN"
SWEEP_PID_ENV = "HARNESS_SWEEP_PID"
SWEEP_ID_ENV = "HARNESS_SWEEP_ID"


def set_parent_death_signal(parent: int | None = None) -> None:
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
                kwargs["preexec_fn"] = functools.partial(set_parent_death_signal, os.getpid())
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
