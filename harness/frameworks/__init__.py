"""The engines behind one interface (TrainingEngine), so the runner, the comparison and the sweeps
treat them alike: one package per engine (single, deepspeed, fsdp, megatron here; the own engine's is
harness/engine), each with facts.py (`ENGINE = harness.registry.EngineFacts(...)`: the fields it
honours and their values, its rules, label and launcher; no torch at import, since the spec and the
reports read it), adapter.py (`build(spec, shape, ctx)`, which imports the engine only when called)
and its heavy modules. harness.registry maps each engine's name to its package.

Every engine follows the workload's precision policy (harness.model.training.PrecisionPolicy);
where a framework cannot, the spec refuses the combination (ENGINE.precision_limits).
"""

from __future__ import annotations

import typing

from harness import registry


class TrainingEngine(typing.Protocol):
    """What build_engine returns, whatever the framework. What an engine can or cannot measure is
    declared here (times_own_communication, process_groups), never guessed from what it returns."""

    times_own_communication: typing.ClassVar[bool]
    """True where last_step_details()["breakdown_s"] splits compute from each axis's communication
    (compute, tp_comm, dp_comm, bubble, optimizer, total: harness.profiling.record.from_instrumented
    reads it; the own engine); False where it times only whole phases or nothing."""

    def train_step(self, global_batch) -> typing.Any:
        """One optimizer step on the step's global batch [global_batch_size, seq_len + 1]; returns the
        global mean loss as a tensor (the same number on every rank)."""

    def full_state_dict(self) -> dict | None:
        """Gathered fp32 parameters named as the plain Llama's, on global rank 0 (None elsewhere)."""

    def grad_norm(self) -> float | None:
        """The last step's global L2 norm of the full gradient before clipping (every shard, stage and
        replica counted once; the same number on every rank), for the parity check; None where the
        framework does not compute it (it is not computed a second time: that would change the step)."""

    def last_step_details(self) -> dict:
        """The last step's breakdown: breakdown_s, comm, pipeline_timeline (missing keys: not measured)."""

    def describe(self) -> dict:
        """What the record says about the engine."""

    def memory_census(self) -> dict | None:
        """Bytes per category (parameters, gradients, master_parameters, optimizer_states) and dtype this
        rank held at its first optimizer step (harness.measure.census.CensusAtStep); None: not measured."""

    def activation_exclusions(self) -> list:
        """Tensors autograd may save that are not activations (the parameters, gathered copies of them)."""

    def router_stats(self) -> dict:
        """A MoE's routing since the last call, {layer: statistics} in harness.model.moe.take_router_stats'
        format, counting each of this rank's tokens once over the ranks ({} where another rank counts them,
        and for a dense model)."""

    def process_groups(self) -> dict:
        """{axis: [process groups]} the profiler's axis names cannot be read from (a group's ranks alone do
        not tell it from another axis of the same ranks, and it carries no group_desc); {}: none."""


def gather_on_rank0(mine: dict | None) -> dict | None:
    """Merge every rank's {name: tensor} (None from ranks that own nothing) on global rank 0, for
    full_state_dict(); None elsewhere. Collective: every rank calls it."""
    import torch.distributed as dist

    everyone: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    out: dict = {}
    for part in everyone:
        out.update(part or {})
    return out


def build_engine(spec, shape, ctx) -> TrainingEngine:
    return registry.adapter(spec.layout.engine).build(spec, shape, ctx)
