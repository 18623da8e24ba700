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
"""

from __future__ import annotations

from harness.errors import SpecError
from harness.memtrace import fsdp, own
from harness.memtrace.standins import traced_attention
from harness.memtrace.step import RankTrace
from harness.parallel_dims import ParallelDims


def stage_ranks(lay) -> list[int]:
    """The first rank (tp 0, cp 0, dp 0) of each pipeline stage: its tensor-, context- and
    data-parallel ranks hold tensors of the same sizes (cp: every rank seq / cp tokens, two equal
    chunks; the ring's blocks are the same sizes in another order)."""
    dims = ParallelDims.of(lay)
    return [dims.rank(pp=s) for s in range(lay.pp)]


def trace_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build the spec's engine (own or fsdp) as global `rank` of its layout on fake tensors and
    run one step."""
    if spec.layout.engine == "fsdp":
        return fsdp.trace_rank(spec, shape, rank, full_micro)
    return own.trace_rank(spec, shape, rank, full_micro)


def substitutions(spec) -> list[str]:
    lay = spec.layout
    out = []
    if traced_attention(lay.attention, lay) != lay.attention:
        out.append(f"attention {lay.attention}: traced as CPU flash SDPA (same saved tensors: q, k, v, output, "
                   "fp32 log-sum-exp; no s x s)")
    if lay.rmsnorm == "fused":
        out.append("rmsnorm fused: a kernel saving its input and fp32 1/rms, allocating only outputs")
    out.append("AdamW fused (the engine's CUDA optimizer)")
    if lay.engine == "fsdp":
        if lay.pp > 1:
            out.append("torch.distributed.pipelining's P2P shape vote skipped: static (every stage's shapes are given)")
        return out
    if lay.pp > 1 and lay.pipeline_p2p == "auto":
        out.append("pipeline transfers grouped, one coalesced work per group (NCCL)")
    return out


def check_traceable(spec) -> None:
    if spec.layout.engine == "fsdp" and spec.layout.cp > 1:
        raise SpecError("layout.cp", "harness memory traces context parallelism under engine own; torch's "
                                     "context_parallel (engine fsdp) dispatches only CUDA attention kernels")
    if spec.layout.engine == "deepspeed":
        raise SpecError("layout.engine", "harness memory traces engines own and fsdp; DeepSpeed's initialize is "
                                          "not traceable on fake tensors (set engine: own or fsdp)")
    if spec.layout.engine not in ("own", "fsdp"):
        raise SpecError("layout.engine", f"harness memory traces engines own and fsdp; {spec.layout.engine!r} is "
                                          "not traced (set engine: own or fsdp to trace this layout under it)")
