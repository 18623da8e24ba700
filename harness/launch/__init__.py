"""Launch one run as its own process tree, enforce a timeout, and classify the outcome.

Why this package exists: a sweep of hundreds of layouts only survives if every run is fenced
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

The command line is command.py, the processes' environment environment.py, one run from start
to record supervise.py, the fencing processes.py, the outcome outcome.py, the stale build locks
build_lock.py, the run's notes on the console relay.py, the kernels checked before a launch machine.py.
"""

from __future__ import annotations

from harness.launch.command import (
    LAUNCHERS,
    LOCAL_LAUNCHERS,
    build_command,
    check_launcher,
    free_port,
    recorded_command,
)
from harness.launch.environment import cpu_cores, run_env, threads_per_process
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
    terminate,
)
from harness.launch.supervise import run_spec

__all__ = [
    "FENCE_MODULE",
    "LAUNCHERS",
    "LOCAL_LAUNCHERS",
    "RANK_EXIT",
    "SWEEP_ID_ENV",
    "SWEEP_PID_ENV",
    "TAIL_LINES",
    "TOKEN_ENV",
    "build_command",
    "check_launcher",
    "classify_output",
    "cpu_cores",
    "error_excerpt",
    "fenced",
    "first_error_line",
    "first_failure",
    "first_failure_line",
    "free_port",
    "kill_run",
    "lead_with_error_line",
    "processes_with_env",
    "reap_orphans_of_dead_sweeps",
    "recorded_command",
    "run_env",
    "run_spec",
    "tail",
    "terminate",
    "threads_per_process",
]
