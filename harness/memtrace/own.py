"""The own engine's tracer: Engine3D (harness/engine) built as one rank of the layout on fake
tensors, and its real train_step run and counted (step.py). The process groups are built before
fake mode (Mesh.get); the engine is built under FakeTensorMode (tensors carry shapes and dtypes, no
data: a 65B stage costs no memory) and runs the schedule's forwards and backwards of the
micro-batches (under context parallelism its attention's K/V exchange too, on the fake group), the
data-parallel reductions, the optimizer step, the parameter refresh.

Under the build, modules on the meta device stay real meta tensors, as outside a trace
(_MetaStaysReal), so Module.to_empty assigns fresh fake parameters as it does to real ones.
"""

from __future__ import annotations

import contextlib
import io
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.measure.census import SavedActivations, storage_identity
from harness.memtrace.live import LiveTensors
from harness.memtrace.standins import traced_options
from harness.memtrace.step import (
    Phases,
    RankTrace,
    census_at_step,
    create_optimizer_states,
    rank_trace,
    run_step,
    traced_spec,
)
from harness.memtrace.world import fake_world
from harness.parallel_dims import ParallelDims


def check_traceable(spec) -> None:
    """The own engine's trace runs every layout the engine runs."""


def substitutions(lay) -> list[str]:
    """What the trace of the own engine substitutes beyond the common stand-ins (trace.substitutions)."""
    if lay.pp > 1 and lay.pipeline_p2p == "auto":
        return ["pipeline transfers grouped, one coalesced work per group (NCCL)"]
    return []


class _MetaStaysReal(TorchDispatchMode):
    """Under FakeTensorMode, an op on the meta device (a module built under torch.device("meta"))
    runs outside it: real meta tensors, as outside a trace. Module.to_empty then assigns each one
    a fresh fake parameter; a fake meta parameter it would swap, and torch.utils.swap_tensors
    refuses the tensors FakeTensorMode keeps weak references to. Entered inside FakeTensorMode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if "device" in kwargs:
            meta = torch.device(kwargs["device"]).type == "meta"
        else:
            meta = bool(tensors) and all(t.device.type == "meta" and not isinstance(t, FakeTensor) for t in tensors)
        if not meta:
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def trace_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build the own engine as global `rank` of the spec's layout on fake tensors and run one step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.engine.engine import Engine3D
    from harness.engine.topology import Mesh

    dims = ParallelDims.of(spec.layout)
    run_spec, m, m_run = traced_spec(spec, dims.coord(rank).pp, full_micro)
    lay = run_spec.layout
    world = dims.world
    t0 = time.perf_counter()
    cached = set(Mesh._cache)

    def forget_meshes():
        for key in set(Mesh._cache) - cached:
            Mesh._cache.pop(key, None)

    with fake_world(rank, world, forget_meshes) as ctx:
        Mesh.get(dims, rank, True)  # the process groups, outside fake mode
        live = LiveTensors()
        phases = Phases(live)
        with FakeTensorMode(allow_non_fake_inputs=True), live, contextlib.redirect_stderr(io.StringIO()):
            with _MetaStaysReal():
                eng = Engine3D(run_spec, shape, ctx, options=traced_options(lay, phases))
            eng.census.result = {}  # its census keys storages by address, which fake ones lack: ours below
            create_optimizer_states(eng.optimizer)
            census = census_at_step(eng.optimizer, eng.census.tensors)
            batch = torch.zeros((run_spec.workload.global_batch_size, run_spec.workload.seq_len + 1), dtype=torch.int64)
            saved = SavedActivations(eng.activation_exclusions(), key=storage_identity)
            step = run_step(eng, batch, live, saved, phases)
        layers = [[p.layers.start, p.layers.stop] for p in eng.plans]
        out = rank_trace(rank, dims.coord(rank).pp, layers, census, step, saved, phases, m, m_run)
        del eng
        out.seconds = time.perf_counter() - t0
        return out
