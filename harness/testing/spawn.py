"""Run engines in N local gloo processes from Python: equivalence tests and the CPU benchmarks.

`spawn(fn, world, *args)` starts `world` processes (spawn), sets the torch.distributed
environment a launcher would set, calls harness.runtime.init("cpu") and then fn(ctx, *args) in
each; rank 0's return value comes back (every rank's with every_rank=True). Several engines can
be built one after another in the same processes, which pays process start-up, group creation
and DeepSpeed's import once per launch rather than once per layout; `spawn_jobs` runs several
functions (jobs) one after another in one launch and tells each job's outcome apart
(harness.testing.launches shares a launch among test files that way).
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.launch import free_port


def _worker(rank, world, port, threads, q, jobs):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(threads),
    )
    from harness import runtime
    from harness.launch.build_lock import use_environment_dir

    use_environment_dir()  # as `harness train` does: DeepSpeed's CPU op built once for the environment's runs

    ctx = runtime.init("cpu")
    try:
        for index, (fn, args, every_rank) in enumerate(jobs):
            try:
                out = fn(ctx, *args)
            except BaseException:  # noqa: BLE001 - carried to the parent with its traceback
                q.put(("error", rank, index, f"rank {rank}:\n{traceback.format_exc()}"))
                raise
            if rank == 0 or every_rank:  # plain bytes: tensors through a torch queue need the sender alive
                buf = io.BytesIO()
                torch.save(out, buf)
                q.put(("ok", rank, index, buf.getvalue()))
    finally:
        try:
            runtime.teardown(ctx)
        except Exception:  # noqa: BLE001 - a peer that died already
            pass


def _error_in(q) -> tuple[int, str] | None:
    """The first error a rank left in the queue (its job's index and traceback), if any."""
    try:
        while True:
            status, _, index, value = q.get(timeout=1.0)
            if status == "error":
                return index, value
    except queue.Empty:
        return None


NOT_RUN = object()  # a job's outcome when its launch ended before it ran


@dataclass
class Job:
    """fn(ctx, *args) on every rank of a launch; rank 0's result comes back, or every rank's."""

    fn: Callable
    args: tuple = ()
    every_rank: bool = False
    timeout_s: float = 300.0


def spawn_jobs(jobs: list[Job], world: int, threads: int | None = None) -> list:
    """Each job in turn in the same `world` processes: per job its result (rank 0's, or the list of every
    rank's), the exception that failed it, or NOT_RUN where another job's failure ended the launch before
    it ran (or finished). A rank that raises or dies fails the job it was in; one that outlives the job's
    timeout_s (counted from the end of the job before) fails it too: a hang must fail a test, not stall it."""
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    mctx = mp.get_context("spawn")
    q = mctx.Queue()
    port = free_port()
    plan = [(j.fn, j.args, j.every_rank) for j in jobs]
    procs = [mctx.Process(target=_worker, args=(r, world, port, threads, q, plan), daemon=False) for r in range(world)]
    for p in procs:
        p.start()
    got: list[dict[int, object]] = [{} for _ in jobs]
    outcome: list = [NOT_RUN] * len(jobs)
    wanted = [world if j.every_rank else 1 for j in jobs]
    current = 0
    deadline = time.monotonic() + jobs[0].timeout_s
    try:
        while current < len(jobs):
            try:
                status, rank, index, value = q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    outcome[current] = TimeoutError(f"{world} ranks did not finish in {jobs[current].timeout_s:g} s")
                    break
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:  # its error, if it sent one before dying, names the job it was in
                    late = _error_in(q)
                    index = late[0] if late else current
                    outcome[index] = RuntimeError(
                        late[1] if late else f"rank process exited with {dead[0].exitcode} without a result"
                    )
                    break
                continue
            if status == "error":
                outcome[index] = RuntimeError(value)
                break
            got[index][rank] = torch.load(io.BytesIO(value), weights_only=False)
            while current < len(jobs) and len(got[current]) == wanted[current]:
                res = got[current]
                outcome[current] = [res[r] for r in range(world)] if jobs[current].every_rank else res[0]
                current += 1
                if current < len(jobs):
                    deadline = time.monotonic() + jobs[current].timeout_s
        else:
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        from harness.runtime import remove_deepspeed_shm_buffers

        remove_deepspeed_shm_buffers("127.0.0.1", port)  # what a killed rank could not unlink
    return outcome


def spawn(fn, world: int, *args, timeout_s: float = 300.0, threads: int | None = None, every_rank: bool = False):
    """fn(ctx, *args) on `world` ranks; rank 0's result, or the list of every rank's. A rank that
    raises, dies or outlives `timeout_s` fails the call (a hang must fail a test, not stall it)."""
    (out,) = spawn_jobs([Job(fn, args, every_rank, timeout_s)], world, threads)
    if isinstance(out, BaseException):
        raise out
    return out


def run_losses(ctx, runs: list[dict], steps: int, with_state: bool = False) -> list[dict]:
    """Build each spec dict's engine in turn, train `steps` steps; losses (and weights) per run."""
    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.spec import parse_spec

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        shape = spec.shape()
        engine = build_engine(spec, shape, ctx)
        source = token_source(spec.workload, shape.vocab)
        losses = [float(engine.train_step(source.global_batch_at(step))) for step in range(steps)]
        state = engine.full_state_dict() if with_state else None
        out.append({"losses": losses, "state": state, "describe": engine.describe()})
        del engine
    return out
