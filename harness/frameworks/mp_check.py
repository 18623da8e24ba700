"""Run engines in N local gloo processes from Python: equivalence tests and the CPU benchmark.

`spawn(fn, world, *args)` starts `world` processes (spawn), sets the torch.distributed
environment a launcher would set, calls harness.dist.init("cpu") and then fn(ctx, *args) in
each; rank 0's return value comes back. Several engines can be built one after another in the
same processes, which pays DeepSpeed's import and initialisation once per launch.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback

import torch


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, threads, q, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
    from harness import dist as hd

    ctx = hd.init("cpu")
    try:
        out = fn(ctx, *args)
        if rank == 0:  # plain bytes: tensors through a torch queue would need the sender alive
            buf = io.BytesIO()
            torch.save(out, buf)
            q.put(("ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - carried to the parent with its traceback
        q.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        try:
            hd.teardown(ctx)
        except Exception:  # noqa: BLE001 - a peer that died already
            pass


def spawn(fn, world: int, *args, timeout_s: float = 300.0, threads: int | None = None):
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    mctx = mp.get_context("spawn")
    q = mctx.Queue()
    port = _free_port()
    procs = [mctx.Process(target=_worker, args=(r, world, port, threads, q, fn, args), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    result = None
    try:
        while True:
            try:
                status, value = q.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engines did not finish in {timeout_s:g} s") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank process exited with {dead[0].exitcode} without a result")
                continue
            if status == "error":
                raise RuntimeError(value)
            result = torch.load(io.BytesIO(value), weights_only=False)
            break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return result


def run_losses(ctx, runs: list[dict], steps: int, with_state: bool = False) -> list[dict]:
    """Build each spec dict's engine in turn, train `steps` steps; losses (and weights) per run."""
    from harness.data import token_source
    from harness.frameworks import build_engine
    from harness.spec import check_sizes, parse_spec

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        shape = check_sizes(spec)
        engine = build_engine(spec, shape, ctx)
        source = token_source(spec.workload, shape.vocab)
        losses = [engine.train_step(source.global_batch_at(step)) for step in range(steps)]
        state = engine.full_state_dict() if with_state else None
        out.append({"losses": losses, "state": state, "describe": engine.describe()})
        del engine
    return out


def reference_run(workload: dict, steps: int, **layout) -> tuple[list[float], dict]:
    """The single-device reference in this process: (losses, final fp32 weights)."""
    from harness.data import token_source
    from harness.frameworks.single import SingleDeviceEngine
    from harness.spec import check_sizes, parse_spec

    spec = parse_spec({"workload": dict(workload), "layout": {"engine": "single", **layout}})
    shape = check_sizes(spec)
    engine = SingleDeviceEngine(spec, shape, torch.device("cpu"))
    source = token_source(spec.workload, shape.vocab)
    losses = [engine.train_step(source.global_batch_at(step)) for step in range(steps)]
    return losses, engine.full_state_dict()


def assert_matches_reference(result: dict, ref_losses: list[float], ref_state: dict | None, label: str,
                             loss_rtol: float = 1e-5) -> None:
    """Losses within `loss_rtol` relative at every step; final weights close (fp32)."""
    losses = result["losses"]
    if len(losses) != len(ref_losses):
        raise AssertionError(f"{label}: {len(losses)} losses vs {len(ref_losses)}")
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > loss_rtol * abs(b):
            raise AssertionError(f"{label}: step {step} loss {a!r} vs reference {b!r} "
                                 f"(rel {abs(a - b) / abs(b):.2e} > {loss_rtol:g})")
    if ref_state is not None:
        state = result["state"]
        if set(state) != set(ref_state):
            raise AssertionError(f"{label}: parameter names differ: {sorted(set(state) ^ set(ref_state))[:5]}")
        for name, ref in ref_state.items():
            torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label}: {name}: {m}")
