"""Run engines in N local gloo processes from Python: equivalence tests and the CPU benchmarks.

`spawn(fn, world, *args)` starts `world` processes (spawn), sets the torch.distributed
environment a launcher would set, calls harness.runtime.init("cpu") and then fn(ctx, *args) in
each; rank 0's return value comes back (every rank's with every_rank=True). Several engines can
be built one after another in the same processes, which pays process start-up, group creation
and DeepSpeed's import once per launch rather than once per layout.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback

import torch

from harness.launch import free_port


def _worker(rank, world, port, threads, q, every_rank, fn, args):
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

    ctx = runtime.init("cpu")
    try:
        out = fn(ctx, *args)
        if rank == 0 or every_rank:  # plain bytes: tensors through a torch queue need the sender alive
            buf = io.BytesIO()
            torch.save(out, buf)
            q.put(("ok", rank, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - carried to the parent with its traceback
        q.put(("error", rank, f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        try:
            runtime.teardown(ctx)
        except Exception:  # noqa: BLE001 - a peer that died already
            pass


def spawn(fn, world: int, *args, timeout_s: float = 300.0, threads: int | None = None, every_rank: bool = False):
    """fn(ctx, *args) on `world` ranks; rank 0's result, or the list of every rank's. A rank that
    raises, dies or outlives `timeout_s` fails the call (a hang must fail a test, not stall it)."""
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    mctx = mp.get_context("spawn")
    q = mctx.Queue()
    port = free_port()
    procs = [
        mctx.Process(target=_worker, args=(r, world, port, threads, q, every_rank, fn, args), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results: dict[int, object] = {}
    wanted = world if every_rank else 1
    try:
        while len(results) < wanted:
            try:
                status, rank, value = q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} ranks did not finish in {timeout_s:g} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank process exited with {dead[0].exitcode} without a result") from None
                continue
            if status == "error":
                raise RuntimeError(value)
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(world)] if every_rank else results[0]


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
