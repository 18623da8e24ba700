"""The common driver of a trace: one rank of an engine at full size on fake tensors, what it holds
and its peak, whichever engine's tracer (own.py, fsdp.py) builds it; what the result names as
substituted; which specs can be traced at all; which ranks stand for the layout.

For each pipeline stage (tensor-, context- and data-parallel ranks of a stage hold the same
tensors, up to a ZeRO-1 shard's padding), `trace_rank` starts a fake process group (world.py) as
that stage's first rank, builds the engine under FakeTensorMode (tensors carry shapes and dtypes,
no data: a 65B stage costs no memory) with the target's kernels, optimizer and transfers
(standins.py), and runs its real train_step while counting every tensor storage alive (live.py),
the memory census of the model states at the optimizer step and the bytes autograd saves
(step.py).

Which tracer builds an engine is the engine's facts' word (harness.registry, EngineFacts.tracer:
a module name); an engine whose tracer is None is not traced, and its facts' `untraced` says why.
Every tracer module offers the same three functions:
  trace_rank(spec, shape, rank, full_micro=False) -> step.RankTrace
                     build the engine as global `rank` of the spec's layout on fake tensors, run one step
  substitutions(lay) -> list[str]
                     what it substitutes beyond the common stand-ins (named here, in substitutions)
  check_traceable(spec) -> None
                     a SpecError for a layout its trace cannot run
"""

from __future__ import annotations

import importlib

from harness import registry
from harness.errors import SpecError
from harness.memtrace.standins import traced_attention
from harness.memtrace.step import RankTrace
from harness.parallel_dims import ParallelDims


def stage_ranks(lay) -> list[int]:
    """The first rank (tp 0, cp 0, dp 0) of each pipeline stage: its tensor-, context- and
    data-parallel ranks hold tensors of the same sizes (cp: every rank seq / cp tokens, two equal
    chunks; the ring's blocks are the same sizes in another order)."""
    dims = ParallelDims.of(lay)
    return [dims.rank(pp=s) for s in range(lay.pp)]


def traced_engines() -> list[str]:
    """The engines whose facts name a tracer, in the registry's order."""
    return [name for name in registry.ENGINES if registry.available(name) and registry.facts(name).tracer is not None]


def tracer(engine: str):
    """The tracer module of `engine` (its facts' tracer); a SpecError if it is not traced."""
    facts = registry.facts(engine)
    if facts.tracer is None:
        traced = traced_engines()
        either = " or ".join(traced)
        if facts.untraced:
            raise SpecError(
                "layout.engine",
                f"harness memory traces engines {' and '.join(traced)}; {facts.untraced} (set engine: {either})",
            )
        raise SpecError(
            "layout.engine",
            f"harness memory traces engines {' and '.join(traced)}; {engine!r} is "
            f"not traced (set engine: {either} to trace this layout under it)",
        )
    return importlib.import_module(facts.tracer)


def trace_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build the spec's engine as global `rank` of its layout on fake tensors (its tracer's
    trace_rank) and run one step."""
    return tracer(spec.layout.engine).trace_rank(spec, shape, rank, full_micro)


def substitutions(spec) -> list[str]:
    """What the trace ran in place of what the target runs (standins.py), in words: the common
    stand-ins, then the engine's tracer's."""
    lay = spec.layout
    out = []
    if traced_attention(lay.attention) != lay.attention:
        out.append(
            f"attention {lay.attention}: traced as CPU flash SDPA (same saved tensors: q, k, v, output, "
            "fp32 log-sum-exp; no s x s)"
        )
    if lay.rmsnorm == "fused":
        out.append("rmsnorm fused: a kernel saving its input and fp32 1/rms, allocating only outputs")
    out.append("AdamW fused (the engine's CUDA optimizer)")
    if spec.shape().moe:
        out.append(
            "mixture of experts: routing even, tokens x k / experts slots per expert and as many to every ep rank "
            "(the real counts are data, which fake tensors do not have); router statistics not traced"
        )
    return out + tracer(lay.engine).substitutions(lay)


def check_traceable(spec) -> None:
    """A SpecError if `harness memory` cannot trace the spec: its engine has no tracer, or the
    tracer cannot run its layout."""
    if spec.workload.precision == "fp8":
        raise SpecError(
            "workload.precision",
            "harness memory does not trace fp8: torchao's Float8Linear is not built on fake tensors here; "
            "trace precision bf16 (FP8 adds no persistent state outside FSDP2's FP8 all-gather scales)",
        )
    tracer(spec.layout.engine).check_traceable(spec)
