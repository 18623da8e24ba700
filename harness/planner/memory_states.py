"""The model states one rank of a harness engine holds (parameters, gradients, masters, optimizer
moments) by census category, and the group its mixture-of-experts states are sharded over: split from
memory_engines, which adds them to a stage's memory."""

from __future__ import annotations

import functools

from harness import registry
from harness.planner import feedforward
from harness.planner.layout import PlannerLayout
from harness.registry import MemoryModel

__all__ = ["expert_shard_group", "memory_model", "model_states", "states_bytes", "states_by_category"]


@functools.cache
def memory_model(engine: str) -> MemoryModel:
    """What the engine's facts say the planner's memory model reads of it (harness.registry.MemoryModel)."""
    model = registry.facts(engine).memory
    if model is None:
        raise ValueError(f"the planner has no memory model of engine {engine!r} (its facts declare none)")
    return model


def model_states(params: float, engine: str, zero_stage: int, precision: str, dp: int, **policy) -> dict[str, dict]:
    """Bytes per category and dtype of the model states one rank of `engine` holds at the optimizer
    step, for `params` parameters on the rank, under the workload's precision policy (`policy`:
    states_bytes' grad_accum, grad_reduce, reduce_bucket_elements): the same categories as a run's
    measured memory census (harness.measure.census.tensor_census), so a prediction and a census compare term
    by term (tests/test_planner_census.py). Adam's step counters and alignment padding are left out
    (under 1%). The closed form is the engine's MemoryModel.states."""
    return states_bytes(params, memory_model(engine).states, zero_stage, precision, dp, **policy)


def states_bytes(
    params: float,
    states: str,
    zero_stage: int,
    precision: str,
    dp: int,
    grad_accum: str = "fp32",
    grad_reduce: str = "fp32",
    reduce_bucket_elements: float = 0.0,
) -> dict[str, dict[str, float]]:
    """model_states by the closed form's name (MemoryModel.states)."""
    P, B = float(params), {"fp32": 4, "bf16": 2}
    mixed = precision == "bf16"
    acc, red = (grad_accum, grad_reduce) if mixed else ("fp32", "fp32")
    out: dict[str, dict[str, float]] = {
        "parameters": {},
        "gradients": {},
        "master_parameters": {},
        "optimizer_states": {},
    }

    def add(category: str, dtype: str, elements: float) -> None:
        if elements:
            out[category][dtype] = out[category].get(dtype, 0.0) + elements * B[dtype]

    if states == "fsdp":  # the sharded fp32 parameters are the master; the gathered bf16 ones are gone
        add("parameters", "fp32", P / dp)
        add("gradients", "fp32", P / dp)
        add("optimizer_states", "fp32", 2 * P / dp)
        return out
    # harness/engine/data_parallel.py, Megatron's layout; Megatron-core's own (engine megatron) holds the same:
    # main_grad in its DDP's contiguous buffer (one dtype to accumulate and reduce), its DistributedOptimizer
    # reduce-scattering into this rank's view of it and sharding the fp32 masters and Adam's moments over dp
    if states == "megatron":
        shard = P / dp if zero_stage >= 1 and dp > 1 else P
        add("parameters", "bf16" if mixed else "fp32", P)
        add("gradients", acc, P)  # the main gradients; ZeRO-1 reduce-scatters in place, into their shard
        if acc != "fp32":  # the fp32 reduced gradient the masters step with (ZeRO-1: this rank's shard)
            add("gradients", "fp32", shard)
        if mixed:
            add("master_parameters", "fp32", shard)
        add("optimizer_states", "fp32", 2 * shard)
        return out
    if states == "deepspeed" and zero_stage >= 1:  # ds_configs/README.md, "Precision": what each stage holds
        add("master_parameters", "fp32", P / dp)  # a clone of the partition, fp32 workloads too
        add("optimizer_states", "fp32", 2 * P / dp)
        if zero_stage == 3:
            add("parameters", "bf16" if mixed else "fp32", P / dp)
            add("gradients", acc, P / dp)  # the partition's accumulation buffer
            add("gradients", "fp32", P / dp)  # the fp32 partition gradient the optimizer steps with
            if reduce_bucket_elements:  # the reduce bucket, held for the run: a census category of its own
                out["buffers"] = {}
                add("buffers", red, reduce_bucket_elements)
            return out
        add("parameters", "bf16" if mixed else "fp32", P)
        if mixed and zero_stage == 1 and acc == "fp32":  # BF16_Optimizer
            add("gradients", "bf16", P)  # every .grad, zeroed but kept
            add("gradients", "fp32", P)  # its whole-model fp32 accumulation buffer
        else:
            add("gradients", "fp32", P / dp)
        return out
    raise ValueError(f"no model-state model {states!r} at ZeRO stage {zero_stage}")


@functools.lru_cache(maxsize=4096)  # a plan asks it of every variant of one split
def states_by_category(phi: float, states: str, zero: int, precision: str, dp: int) -> dict[str, float]:
    """Bytes of the model states by census category, as engine_stage_memory holds them."""
    if states == "deepspeed" and zero == 0:  # its pipeline engine without ZeRO: bf16 .grad, an fp32 optimizer copy
        census = states_bytes(phi, "megatron", 0, precision, dp, grad_accum="bf16" if precision == "bf16" else "fp32")
    else:  # the Megatron-style engines shard at most the optimizer states (ZeRO-1)
        census = states_bytes(phi, states, min(zero, 1) if states == "megatron" else zero, precision, dp)
    return {k: sum(v.values()) for k, v in census.items()}


def expert_shard_group(lay: PlannerLayout, states: str) -> int:
    """The ranks one expert's states are sharded over. ZeRO-1 and full sharding: the expert-data-parallel
    group, dp x cp / ep (the ep ranks hold different experts). Hybrid sharding (0 < dp_shard < dp x cp) under
    the FSDP states: ep is carved from the sharding group (torchtitan's dp_shard_mod_ep = dp_shard x cp / ep,
    parallel_dims.py; the harness's engine fsdp shards the experts over dp_mod_ep, fsdp/experts.py), so an
    expert's states are sharded over dp_shard / ep ranks, as full sharding's (dp_shard = dp x cp) are; the
    rest replicate them. predict.validate asks that ep divide dp_shard."""
    if states != "fsdp" or lay.shard_group == lay.replicas:
        return feedforward.expert_data_parallel(lay.dims)
    return max(1, lay.shard_group // lay.ep)
