"""Stand-ins with the target's memory: what the target GPU runs and a CPU (or a fake tensor)
cannot is substituted by something with the same memory behaviour, named in the result
(trace.substitutions), and the engines are built with them (traced_options):
  - attention: every flash-style kernel (sdpa, sdpa_flash, sdpa_efficient, sdpa_cudnn, flash2)
    runs torch's CPU flash SDPA, which saves q, k, v, the output and the fp32 log-sum-exp, no
    s x s matrix (on the meta device SDPA would fall back to the math path and save the scores);
    naive stays naive (it materialises the scores, as on a GPU)
  - rmsnorm fused: a kernel that saves its input and the fp32 per-row 1/rms and allocates only
    its outputs (flash-attn's Triton rms_norm_fn); on a CPU the engine would torch.compile one
  - AdamW fused, as the engine builds it on CUDA (no per-parameter temporaries)
  - pipeline transfers grouped, each group one coalesced work, as on NCCL (layout.pipeline_p2p
    auto); an explicit async stays async
  - a mixture of experts routes evenly (even_counts), the same on every rank: the real counts are
    data, which fake tensors do not have (the own engine's BuildOptions.routing)

The engines are built with harness.model.training.BuildOptions (the kernels above, the fused
optimizer, NCCL's coalesced transfer groups, even routing, weights not loaded, allocation under fake
mode) and
tell the tracer their phases through its StepHooks (step.Phases).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from harness.model.kernels import Kernels
from harness.model.training import BuildOptions, StepHooks, make_adamw
from harness.spec import ATTENTION_KERNELS, subset

FLASH_STYLE = subset(ATTENTION_KERNELS, "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash2")


class _FusedRMSNorm(torch.autograd.Function):
    """The memory of a fused RMSNorm kernel (flash-attn's rms_norm_fn): saves its input, the
    weight and the fp32 per-row 1/rms; allocates only its outputs. Shapes only: no values."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


def traced_attention(kernel: str) -> str:
    """The kernel the trace runs for `kernel`: CPU flash SDPA for every flash-style kernel, also
    under the own engine's context parallelism with cp_impl ring or allgather, whose blocks then run
    torch's CPU flash op (with the LSE, as CUDA's flash, efficient and cuDNN ops: saved q, k, v, output
    and LSE, no s x s; harness/engine/lse_attention.py); naive stays naive (its blocks' fp32 math)."""
    return "sdpa_flash" if kernel in FLASH_STYLE else kernel


def traced_kernels(lay) -> Kernels:
    """The kernels the traced engine is built with (its build-time seam): the layout's, with
    fused RMSNorm replaced by _fused_rmsnorm (attention is substituted in the spec: step.traced_spec)."""
    kernels = Kernels.of(lay.attention, lay.rmsnorm)
    return dataclasses.replace(kernels, rmsnorm=_fused_rmsnorm) if lay.rmsnorm == "fused" else kernels


def _fused_rmsnorm(x, weight, eps):
    """_FusedRMSNorm on plain tensors, or on the local shards of DTensors (engine fsdp's norms
    under TP: the kernel runs on what the rank holds; the output keeps the input's placements)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return _FusedRMSNorm.apply(x, weight.to_local() if isinstance(weight, DTensor) else weight, eps)
    local_weight = weight.to_local() if isinstance(weight, DTensor) else weight
    out = _FusedRMSNorm.apply(x.to_local(), local_weight, eps)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def _fused_adamw(params, workload, **kw):
    """AdamW as the engines build it on CUDA: fused."""
    return make_adamw(params, workload, **{**kw, "fused": True})


def even_counts(slots: int, experts: int) -> list[int]:
    """Routed slots per expert when routing is even (the first slots % experts get one more): what a
    trace on fake tensors, which cannot know the data-dependent counts, dispatches."""
    base, extra = divmod(slots, experts)
    return [base + (e < extra) for e in range(experts)]


def _coalesced_batch_isend_irecv(ops):
    """NCCL's batch_isend_irecv: the group is one coalesced work."""
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    return works[:1]


def traced_options(lay, hooks: StepHooks, materialize=None) -> BuildOptions:
    """How the trace builds an engine: the target's kernels, optimizer and transfers, even routing, no weight
    values."""
    return BuildOptions(
        kernels=traced_kernels(lay),
        make_optimizer=_fused_adamw,
        batch_isend_irecv=_coalesced_batch_isend_irecv,
        routing=even_counts,
        materialize=materialize,
        load_weights=False,
        hooks=hooks,
    )
