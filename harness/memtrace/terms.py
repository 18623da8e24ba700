"""What a trace of tensors cannot see, as named terms, and one traced layout beside the planner.

The terms are the planner's (harness/planner/memory_terms.py, one definition): the CUDA context with
the cuBLAS/cuDNN workspaces and NCCL's communicator buffers (CONTEXT_GIB), and the caching
allocator's fragmentation as a fraction of the memory that comes and goes within a step
(FRAGMENTATION, FRAGMENTATION_PIPELINED when a pipeline interleaves micro-batches' lifetimes).
"""

from __future__ import annotations

import dataclasses

from harness.planner.memory import CONTEXT_GIB, FRAGMENTATION, FRAGMENTATION_PIPELINED, GIB
from harness.spec.schema import BF16_PRECISIONS


def named_terms(dynamic_bytes: float, pipelined: bool) -> dict[str, float]:
    """Bytes of each term for a rank whose live tensors rise `dynamic_bytes` above its model
    states during the step."""
    frag = FRAGMENTATION_PIPELINED if pipelined else FRAGMENTATION
    return {"cuda_context_and_workspaces": CONTEXT_GIB * GIB, "allocator_fragmentation": frag * dynamic_bytes}


def planner_layout(spec):
    """The planner's PlannerLayout and Workload for a run spec (engine own)."""
    from harness.planner.layout import PlannerLayout, Workload

    lay = PlannerLayout.from_spec(dataclasses.asdict(spec.layout))
    lay = dataclasses.replace(lay, engine="own" if spec.layout.engine == "single" else spec.layout.engine)
    w = spec.workload
    return lay, Workload(w.seq_len, w.global_batch_size, 2 if w.precision in BF16_PRECISIONS else 4, w.optimizer.name)


def planner_stages(spec, shape) -> tuple[int, list[dict]]:
    """The planner's worst stage and its breakdown of every stage, for the spec's layout and engine."""
    from harness.planner.memory import stage_memory, worst_stage_memory

    lay, wl = planner_layout(spec)
    worst, _ = worst_stage_memory(shape, lay, wl)
    return worst, [stage_memory(shape, lay, wl, s) for s in range(lay.pp)]


def pipelined(spec) -> bool:
    """Whether the planner's pipelined fragmentation applies (pp > 1 and more than one micro-batch)."""
    from harness.spec import micro_batches_per_step

    return spec.layout.pp > 1 and micro_batches_per_step(spec) > 1
