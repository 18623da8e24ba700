"""What every engine shares around the model: the optimizer, the precision policy, the
mixed-precision bookkeeping of the single-device reference, and the seams an engine's build
offers a caller that is not a real run (BuildOptions, StepHooks: harness memory).

Kept below the engines and adapters so that the reference, the own engine, DeepSpeed and FSDP2
take the same AdamW and the same precision policy from the workload, from one definition.

The policy (`workload.precision`, `grad_accum_dtype`, `grad_reduce_dtype`): under fp32 every
tensor is fp32 and the parameters are their own master copy. Under bf16 the parameters the
model computes with are bf16; the optimizer keeps fp32 master parameters and fp32 Adam states;
gradients are summed over micro-batches in grad_accum_dtype and reduced across data-parallel
ranks in grad_reduce_dtype (both fp32 by default: Megatron's default with its distributed
optimizer, where bf16 parameters get an fp32 main_grad buffer and fp32 master shards).

Under fp8 (torchtitan's policy) everything is bf16's, and the GEMMs of the linear layers run in
FP8: torchao's convert_to_float8_training with the workload's fp8_recipe (tensorwise, rowwise or
rowwise_with_gw_hp, dynamic scales; mxfp8: torchao's MXFP8 linear, harness/model/mxfp8.py) over the linears
harness.model.float8.converts accepts (not the LM head nor a router; dims multiples of 16, of 32
under mxfp8). Attention's core, the norms, the embedding and the head stay bf16; the FP8
casts are transient (torchao saves the bf16 input and weight for backward), so nothing FP8
persists between steps except, under FSDP2's FP8 all-gather, each weight's precomputed scale.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from harness.model.kernels import Kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONVERT_WORDS = "torchao convert_to_float8_training"
MXFP8_WORDS = "torchao's MXFP8 linear: e4m3 elements, an e8m0 scale per block of 32"
COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}  # precision -> parameters' dtype
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class PrecisionPolicy:
    compute: torch.dtype  # the parameters the model computes with
    master: torch.dtype | None  # the optimizer's copy of them; None: the parameters themselves
    grad_accum: torch.dtype  # gradients summed over micro-batches
    grad_reduce: torch.dtype  # gradients reduced across data-parallel ranks
    optimizer_states: torch.dtype = torch.float32
    fp8: str | None = None  # torchao's recipe for the linear layers' GEMMs (tensorwise, rowwise, mxfp8); None: no FP8

    def describe(self) -> str:
        """The policy in one sentence, the same for every engine that runs it."""
        if self.master is None:
            return "fp32 throughout: parameters, gradients, optimizer states and every collective"
        fp8 = (
            f"; the linear layers' GEMMs in FP8 ({MXFP8_WORDS if self.fp8 == 'mxfp8' else CONVERT_WORDS}, "
            f"{self.fp8} dynamic scaling, not the LM head), attention and norms in bf16"
            + (
                "; their weight gradients in high precision, accumulated in fp32 into the main gradients "
                "where the engine keeps them per parameter (own, single)"
                if self.fuses_weight_gradient
                else ""
            )
            if self.fp8
            else ""
        )
        return (
            f"{dtype_name(self.compute)} parameters for compute, {dtype_name(self.master)} master parameters "
            f"and {dtype_name(self.optimizer_states)} Adam states, gradients accumulated over micro-batches "
            f"in {dtype_name(self.grad_accum)} and reduced across data-parallel ranks in "
            f"{dtype_name(self.grad_reduce)}{fp8}"
        )

    @property
    def fuses_weight_gradient(self) -> bool:
        """Whether the FP8 linears' weight gradients go into fp32 main gradients directly (Megatron's
        gradient_accumulation_fusion, harness.model.float8._FusedWeightGradient): under fp8_recipe
        rowwise_with_gw_hp, whose weight gradient is a high-precision GEMM, with fp32 main gradients.
        The engines that keep one per parameter (the reference's MasterWeights, the own engine's buckets)
        fuse; FSDP2 and DeepSpeed take torchao's bf16 product into their own gradient bookkeeping."""
        return self.fp8 == "rowwise_with_gw_hp" and self.master is not None and self.grad_accum == torch.float32

    @property
    def peak_matmul_dtype(self) -> torch.dtype:
        """The dtype of the square matmul whose measured peak a run's MFU is also given against: the one its
        parameters compute in, bf16 under fp8 too (as the datasheet's dense bf16 peak: what FP8 GEMMs gain
        shows as a higher MFU, not as a higher peak)."""
        return self.compute

    def convert_fp8(self, module, device_type: str, fsdp_all_gather: bool = False):
        """`module` with its linears converted to FP8 training under this policy (a no-op without FP8)."""
        if not self.fp8:
            return module
        from harness.model import float8

        return float8.convert(module, self.fp8, device_type, fsdp_all_gather)

    def fp8_persistent_bytes(self, fp8_linears: int, fsdp_all_gather: bool = False) -> int:
        """What FP8 adds to a rank's memory census at the optimizer step (census category fp8), given how
        many linears it converted: nothing where the casts are transient (torchao's dynamic scaling keeps
        no FP8 weight copy between steps and saves the bf16 input and weight for backward), one fp32
        scale per converted weight under FSDP2's FP8 all-gather (precompute_float8_dynamic_scale_for_fsdp's
        _precomputed_scale; the all-gathered FP8 weights are freed at reshard, as bf16 ones are)."""
        return 4 * fp8_linears if self.fp8 and fsdp_all_gather else 0

    def reference_census(self, params: int, tensors: int) -> dict[str, dict[str, int]]:
        """The closed form of the reference's census at its first optimizer step (MasterWeights and AdamW
        over `params` elements in `tensors` parameter tensors): parameters in the compute dtype, fp32
        masters and main gradients (the masters' .grad are those), AdamW's two fp32 moments and a 0-dim
        fp32 step per tensor; plus what FP8 keeps (nothing: fp8_persistent_bytes)."""
        width = {torch.float32: 4, torch.bfloat16: 2}
        out = {
            "parameters": {dtype_name(self.compute): width[self.compute] * params},
            "gradients": {"fp32": 4 * params},
            "optimizer_states": {"fp32": 8 * params + 4 * tensors},
        }
        if self.master is not None:
            out["master_parameters"] = {"fp32": 4 * params}
        return out

    def fp8_backend(self, device_type: str) -> str | None:
        """How this machine runs the FP8 GEMMs (harness.model.float8.recipe_backend), None without FP8."""
        if not self.fp8:
            return None
        from harness.model import float8

        return float8.recipe_backend(self.fp8, device_type)


def precision_policy(workload) -> PrecisionPolicy:
    if workload.precision == "fp32":
        return PrecisionPolicy(torch.float32, None, torch.float32, torch.float32)
    return PrecisionPolicy(
        COMPUTE[workload.precision],
        torch.float32,
        DTYPES[workload.grad_accum_dtype],
        DTYPES[workload.grad_reduce_dtype],
        fp8=workload.fp8_recipe if workload.precision == "fp8" else None,
    )


def make_adamw(params, workload, **kw):
    o = workload.optimizer
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **kw)


class StepHooks:
    """Where an engine's train_step is, told to an observer (harness memory names its peak by
    these and counts what the first forward saves), so that none needs the engine's private
    methods. No-ops here; `where` names the phase in words ("forward chunk 0 micro-batch 1")."""

    def forward(self, where: str) -> None:
        """A micro-batch's forward starts (on the last stage its loss is part of it)."""

    def forward_end(self) -> None:
        """That forward has ended: what it saves for backward is saved."""

    def backward(self, where: str) -> None:
        """A micro-batch's backward starts."""

    def optimizer(self, where: str) -> None:
        """Every forward and backward has run; the rest of the step (reductions, clipping, the
        optimizer step) follows."""


@dataclass(frozen=True)
class BuildOptions:
    """How an engine is built where a real run's way does not fit the caller: harness memory
    builds engines on fake tensors (harness/memtrace). The defaults are a real run's."""

    make_optimizer: Callable = make_adamw  # (params, workload, fused=...) -> the optimizer
    kernels: Kernels | None = None  # attention and RMSNorm functions; None: those the layout names
    batch_isend_irecv: Callable | None = None  # own engine: posts a transfer group; None: torch.distributed's
    # own engine: a MoE's routed slots per expert, (slots, experts) -> counts, in place of the data's (harness
    # memory: even, as fake tensors have no data; no router statistics then); None: the data's
    routing: Callable | None = None
    hooks: StepHooks = field(default_factory=StepHooks)
    # engine fsdp (the own engine allocates and loads its chunks in harness.engine.model.build_chunks):
    materialize: Callable | None = None  # (module, device): allocates a meta module; None: module.to_empty
    load_weights: bool = True  # copy the reference weights in (values only: a trace skips it)

    def kernels_for(self, layout) -> Kernels:
        """The kernels to build with: the given ones, else those the layout names."""
        return self.kernels or Kernels.of(layout.attention, layout.rmsnorm)

    def allocate(self, module, device):
        """The meta `module` with its parameters and buffers allocated on `device`."""
        if self.materialize is None:
            return module.to_empty(device=device)
        return self.materialize(module, device)


class MasterWeights:
    """The reference's mixed precision, Megatron's way, over the model's (compute-dtype) parameters.

    Under a policy with a master copy: fp32 master parameters are what the optimizer updates;
    after each micro-batch's backward, each parameter's compute-dtype .grad is added into its
    main gradient (grad_accum dtype) and freed - or, with grad_accum equal to the compute
    dtype, left to accumulate in .grad; at the step the master's .grad is the main gradient in
    fp32, and after the step the masters are copied back into the parameters. Under fp32 it is a
    pass-through: the parameters are the masters and .grad accumulates as usual.
    """

    def __init__(self, params: list[torch.nn.Parameter], policy: PrecisionPolicy):
        self.params, self.policy = list(params), policy
        self.mixed = policy.master is not None
        if self.mixed:
            self.masters = [p.detach().to(policy.master).clone() for p in self.params]
            self.main_grads = (
                [torch.zeros_like(p, dtype=policy.grad_accum) for p in self.params]
                if policy.grad_accum != policy.compute
                else None
            )
            if policy.fuses_weight_gradient:  # the FP8 linears add their weight gradients here themselves
                for p, g in zip(self.params, self.main_grads, strict=True):
                    p.main_grad = g
        else:
            self.masters, self.main_grads = self.params, None

    def optimizer_params(self) -> list[torch.Tensor]:
        return self.masters

    def after_backward(self) -> None:
        """Once per micro-batch: move the fresh gradients into the main gradients."""
        if self.main_grads is None:
            return
        for p, g in zip(self.params, self.main_grads, strict=True):
            if p.grad is not None:
                if not getattr(p, "grad_added_to_main_grad", False):
                    g.add_(p.grad)
                p.grad, p.grad_added_to_main_grad = None, False

    def grads_to_masters(self) -> None:
        """Before clipping and the step: the masters' .grad is the accumulated gradient in fp32."""
        if not self.mixed:
            return
        sources = self.main_grads if self.main_grads is not None else [p.grad for p in self.params]
        for m, g in zip(self.masters, sources, strict=True):
            m.grad = None if g is None else g.to(m.dtype)

    def after_step(self) -> None:
        """After the optimizer step: parameters from the updated masters; gradients cleared."""
        if not self.mixed:
            return
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)
                p.grad = None
                m.grad = None
        if self.main_grads is not None:
            for g in self.main_grads:
                g.zero_()

    def census_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this bookkeeping holds, by memory-census category (harness.measure.census.tensor_census)."""
        grads = self.main_grads if self.main_grads is not None else [p.grad for p in self.params]
        if self.mixed:  # at the step the masters' gradients exist too (shared with fp32 main gradients)
            grads = list(grads) + [m.grad for m in self.masters]
        out = {"parameters": self.params, "gradients": [g for g in grads if g is not None]}
        if self.mixed:
            out["master_parameters"] = self.masters
        return out
