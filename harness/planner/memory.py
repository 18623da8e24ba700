"""Bytes per GPU for the worst pipeline stage: model states, activations, logits, overheads.

The front door of the planner's memory model, so that a caller asks one module whatever the
engine: stage_memory sends a stage of the study's engine (PlannerLayout.engine paper) to
memory_paper and one of the harness's engines (own, megatron, deepspeed, fsdp) to
memory_engines; worst_stage_memory finds the fullest stage; fits compares it with a device. The
terms both share (GIB, stage_params, the calibrated CONTEXT_GIB and FRAGMENTATION) live in
memory_terms and are re-exported here.
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner.hardware import Profile
from harness.planner.layout import PlannerLayout, Workload, stage_items
from harness.planner.memory_engines import engine_stage_items, engine_stage_memory, memory_model
from harness.planner.memory_paper import paper_stage_memory
from harness.planner.memory_states import expert_shard_group
from harness.planner.memory_terms import (
    CONTEXT_GIB,
    FRAGMENTATION,
    FRAGMENTATION_PIPELINED,
    GIB,
    muon_saving,
    stage_params,
)

__all__ = [
    "CONTEXT_GIB",
    "FRAGMENTATION",
    "FRAGMENTATION_PIPELINED",
    "GIB",
    "fits",
    "stage_memory",
    "stage_params",
    "worst_stage_memory",
]


def stage_memory(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int) -> dict:
    """Breakdown in bytes for one stage; 'total' is the sum of the parts. The study's engine
    (PlannerLayout.engine paper) in memory_paper; the harness's engines in memory_engines."""
    if lay.engine != "paper":
        parts = engine_stage_memory(shape, lay, wl, stage)
        return _with_muon(shape, lay, wl, stage, parts) if wl.optimizer == "muon" else parts
    return paper_stage_memory(shape, lay, wl, stage)


def _with_muon(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int, parts: dict) -> dict:
    """`parts` with Muon's one momentum in place of AdamW's two moments on the stage's block matrices
    (memory_terms.muon_saving), sharded as memory_engines shards the optimizer states: over the FSDP2 shard
    group, over the replicas under ZeRO-1 (experts: their expert-data-parallel group), else not."""
    fsdp = memory_model(lay.engine).states == "fsdp"
    sharded = fsdp or lay.sharding_stage >= 1
    shard = (lay.shard_group if fsdp else lay.replicas) if sharded else 1
    expert_shard = expert_shard_group(lay, "fsdp" if fsdp else "") if sharded else 1
    layers = engine_stage_items(shape, lay, wl.seq_len)[stage][1]
    saving = muon_saving(shape, lay, layers, shard, expert_shard)
    return {**parts, "optimizer": parts["optimizer"] - saving, "total": parts["total"] - saving}


def worst_stage_memory(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[int, dict]:
    """The stage with the largest total, and its breakdown."""
    best, seen = None, set()
    items = stage_items(shape, lay.pp) if lay.engine == "paper" else engine_stage_items(shape, lay, wl.seq_len)
    for i in range(lay.pp):  # the first stage of each kind holds the most micro-batches
        if (items[i], i == lay.pp - 1) in seen:
            continue
        seen.add((items[i], i == lay.pp - 1))
        parts = stage_memory(shape, lay, wl, i)
        if best is None or parts["total"] > best[1]["total"]:
            best = (i, parts)
    return best


def fits(total_bytes: float, profile: Profile) -> bool:
    return total_bytes <= profile.memory_gib * GIB
