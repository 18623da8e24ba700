"""Engine fsdp's tracer: FSDPEngine (FSDP2 + DTensor TP/SP + torch.distributed.pipelining,
harness/frameworks/fsdp) built as one rank of the layout, its parameters allocated on fake tensors,
and its real train_step run and counted (step.py). Beside the counters it undoes what a trace would
otherwise leave behind (DTensor's caches by mesh) and skips what a fake tensor cannot answer
(pipelining's shape vote).
"""

from __future__ import annotations

import contextlib
import io
import time

import torch

from harness.errors import SpecError
from harness.measure.census import SavedActivations, storage_identity
from harness.memtrace import step
from harness.memtrace.live import LiveTensors
from harness.memtrace.standins import traced_options
from harness.memtrace.world import fake_world
from harness.parallel_dims import ParallelDims


def check_traceable(spec) -> None:
    """What engine fsdp's trace cannot run: its context parallelism (CUDA kernels only)."""
    if spec.layout.cp > 1:
        raise SpecError(
            "layout.cp",
            "harness memory traces context parallelism under engine own; torch's "
            "context_parallel (engine fsdp) dispatches only CUDA attention kernels",
        )


def substitutions(lay) -> list[str]:
    """What the trace of engine fsdp substitutes beyond the common stand-ins (trace.substitutions)."""
    if lay.pp > 1:
        return ["torch.distributed.pipelining's P2P shape vote skipped: static (every stage's shapes are given)"]
    return []


def _micro_batches(lay, m: int, stage: int) -> int:
    """step.traced_micro_batches, but torch's Schedule1F1B takes at least pp micro-batches."""
    if lay.pipeline_schedule == "1f1b" and not (lay.pp == 1 and lay.virtual_stages == 1):
        return min(m, lay.pp + 1)
    return step.traced_micro_batches(lay, m, stage)


def _static_shapes_without_vote(schedule) -> None:
    """torch.distributed.pipelining's first step votes over P2P whether every stage has static
    shapes and reads the vote with .item(), which a fake tensor cannot answer. Engine fsdp gives
    every PipelineStage its input and output shapes up front (fsdp/pipeline.py), so the vote of
    a real run is static: set, without the vote (its 2-rank warm-up transfers carry no memory).

    One of the trace's two overrides of torch (the other: live.py, LiveTensors.counting_resizes), for want
    of a public mechanism: the vote runs in the schedule's private _warmup_p2p at every first
    step, no schedule or stage argument skips it, and the stage's mode it sets is private too.
    Overridden on this schedule object only."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def trace_rank(spec, shape, rank: int, full_micro: bool = False) -> step.RankTrace:
    """Build engine fsdp (harness/frameworks/fsdp/engine.py) as global `rank` of the spec's layout and
    run one step on fake tensors.

    Everything up to the parameters' allocation runs as in a real run, outside fake mode: the
    DeviceMesh over the fake process group (its rank tables are real tensors), the model on the
    meta device, DTensor TP/SP and fully_shard (FSDP2's sharding bookkeeping, on meta). Module.to_empty
    (FSDP2's own: its _apply override re-points every FSDPParam at the new sharded storage,
    reset_sharded_param) then runs under FakeTensorMode (the build's `materialize`), and so does
    the step: FSDP2's all-gathers and reduce-scatters, DTensor's collectives and the optimizer on
    fake tensors. The reference weights are not loaded (values only); AdamW fused as the engine
    builds it on CUDA. FakeTensorMode admits the meta tensors to_empty reads (allow_non_fake_inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.frameworks.fsdp.engine import FSDPEngine

    dims = ParallelDims.of(spec.layout)
    run_spec, m, m_run = step.traced_spec(spec, dims.coord(rank).pp, full_micro, _micro_batches)
    lay = run_spec.layout
    world = dims.world
    t0 = time.perf_counter()
    with fake_world(rank, world, _clear_dtensor_caches) as ctx:
        live = LiveTensors()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        phases = step.Phases(live)

        def materialize(module, device):
            with fake, live:
                return module.to_empty(device=device)

        with contextlib.redirect_stderr(io.StringIO()), live.counting_resizes():
            eng = FSDPEngine(run_spec, shape, ctx, options=traced_options(lay, phases, materialize))
            if eng.pipeline is not None:
                _static_shapes_without_vote(eng.pipeline.schedule)
            eng.census.result = {}  # its census keys storages by address, which fake ones lack: ours below
            with fake, live:
                step.create_optimizer_states(eng.optimizer)
                census = step.census_at_step(eng.optimizer, eng.census.tensors)
                batch = torch.zeros(
                    (run_spec.workload.global_batch_size, run_spec.workload.seq_len + 1), dtype=torch.int64
                )
                saved = SavedActivations(eng.activation_exclusions(), key=storage_identity)
                stepped = step.run_step(eng, batch, live, saved, phases)
        if eng.pipeline is None:
            layers = [[0, shape.layers]]
        else:  # the stage modules' blocks, named by their layer numbers
            layers = [
                [min(map(int, part.layers.keys())), max(map(int, part.layers.keys())) + 1]
                for part in eng.parts
                if len(part.layers)
            ]
        out = step.rank_trace(rank, dims.coord(rank).pp, layers, census, stepped, saved, phases, m, m_run)
        del eng
        out.seconds = time.perf_counter() - t0
        return out


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions and redistribution plans by mesh; a later trace's mesh
    with the same shape compares equal to this one's, whose process groups are gone."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    type(prop)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
