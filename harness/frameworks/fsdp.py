"""engine: fsdp - the same LLaMA under PyTorch's own parallelism, the torchtitan way.

One DeviceMesh (pp, dp, tp), tp innermost (the own engine's rank order, harness/engine/topology.py),
created with init_device_mesh on the existing process group; then, in this order:

  pp  torch.distributed.pipelining: the plain model cut into stage modules of its own pieces,
      PipelineStage per stage, ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B
      (virtual_stages stages per rank) over the mesh's pp dimension (native_pipeline.py);
  tp  DTensor parallelize_module with the Colwise/Rowwise/SequenceParallel plan (native_tp.py);
  ac  `full` wraps every block with torch's checkpoint_wrapper (non-reentrant); `selective` is
      the model's own attention-core recomputation;
  dp  FSDP2 `fully_shard` over the mesh's dp dimension, every block and then the root (the model,
      or each stage module). reshard_after_forward true frees each block's gathered parameters
      after its forward and gathers them again for backward (ZeRO-3-like); false keeps them until
      the backward (ZeRO-2-like). The root is never resharded after forward. Applied at dp=1 too
      (a one-rank group: nothing crosses ranks) so the mixed-precision policy is the same everywhere.

Same as the reference (harness/frameworks/single.py): initial weights (built on the meta device,
sharded, then each rank copies its shard of ReferenceWeights in, one tensor at a time), tokens
(the step's global batch, the contiguous slice of this rank's dp coordinate: every tp rank and
pp stage with the same dp coordinate takes the same rows), loss/len(micro) accumulation
(without pp, gradients are reduce-scattered with averaging over dp after every micro-batch; with
pp once, after the last),
torch.optim.AdamW with the workload's hyperparameters (fused on GPU, as the reference), and
global-norm clipping: the norm over every DTensor shard (tp, dp) and over the pp stages (their
squared norms summed across the pp dimension).

Precision: fp32 workloads use no MixedPrecisionPolicy. bf16 uses
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): parameters are all-gathered and
computed in bf16, gradients reduced in fp32, fp32 sharded master weights and optimizer state.
The reference instead runs fp32 weights under torch.autocast(bf16) (norms and the softmax
stay fp32 there), so bf16 losses differ slightly; describe() says so.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import measure
from harness.data.source import dp_slice
from harness.engine.topology import coord_of
from harness.model.llama import Llama, ReferenceWeights, lm_loss
from harness.model.training import make_adamw
from harness.spec import check_world_size

_WRAPPED = "_checkpoint_wrapped_module."


class FSDPEngine:
    name = "fsdp"

    def __init__(self, spec, shape, ctx):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if ctx.backend is None:
            raise RuntimeError("engine fsdp needs a process group (run it under a launcher)")
        w, lay = spec.workload, spec.layout
        self.spec, self.ctx, self.device = spec, ctx, ctx.device
        self.coord = coord_of(ctx.rank, lay.tp, lay.pp, lay.dp)
        self.mesh = init_device_mesh(ctx.device.type, (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp"))
        if lay.tp > 1:  # lets DTensor reduce the gradient norm over (dp, tp) in one all-reduce, not two
            self.mesh["dp", "tp"]._flatten()
        bf16 = w.precision == "bf16"
        self.mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        ckpt = lay.activation_checkpointing
        # Built on the meta device and sharded before any memory is allocated, so no rank ever
        # holds the whole model on the device.
        with torch.device("meta"):
            model = Llama(shape, lay.attention, lay.rmsnorm, "selective" if ckpt == "selective" else "none")
        self.pipeline = None
        if lay.pp > 1:
            from harness.frameworks.native_pipeline import split_model

            self.parts, plans = split_model(model, spec, self.coord.pp)
        else:
            self.parts, plans = [model], None
        reference = ReferenceWeights(shape, w.seed)
        for part in self.parts:
            self._parallelize(part)
            part.to_empty(device=ctx.device)
            _load_reference_shards(part, reference)
        if plans is not None:
            from harness.frameworks.native_pipeline import Pipeline

            self.pipeline = Pipeline(self.parts, plans, spec, shape, self.mesh["pp"].get_group(), ctx.device,
                                     torch.bfloat16 if bf16 else torch.float32)
        self.is_last_stage = plans is None or any(p.last for p in plans)
        self.params = [p for part in self.parts for p in part.parameters()]
        self.optimizer = make_adamw(self.params, w, fused=ctx.device.type == "cuda")
        self._details: dict = {}

    def _parallelize(self, part) -> None:
        """TP (when tp > 1), activation checkpointing, then FSDP2 over dp: torchtitan's order."""
        from torch.distributed.fsdp import fully_shard

        lay = self.spec.layout
        if lay.tp > 1:
            from harness.frameworks.native_tp import apply_tensor_parallel

            apply_tensor_parallel(part, self.mesh["tp"], lay.sequence_parallel)
        if lay.activation_checkpointing == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)

            for key, block in list(part.layers.named_children()):
                part.layers.register_module(key, checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        dp_mesh = self.mesh["dp"]
        for block in part.layers.children():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=lay.reshard_after_forward, mp_policy=self.mp)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=False, mp_policy=self.mp)

    # ---------------------------------------------------------------- training

    def train_step(self, global_batch: torch.Tensor) -> float:
        w, lay = self.spec.workload, self.spec.layout
        with measure.StepTimer(self.device) as step:
            local = dp_slice(global_batch, self.coord.dp, lay.dp).to(self.device, non_blocking=True)
            with measure.StepTimer(self.device) as fb:
                if self.pipeline is not None:
                    total = self.pipeline.step(local[:, :-1], local[:, 1:])
                else:
                    chunks = local.split(lay.micro_batch_size)
                    total = torch.zeros((), device=self.device, dtype=torch.float32)
                    for chunk in chunks:
                        logits = self.parts[0](chunk[:, :-1])
                        loss = lm_loss(logits, chunk[:, 1:]) / len(chunks)
                        loss.backward()
                        total += loss.detach().float()
            with measure.StepTimer(self.device) as opt:
                if w.grad_clip > 0:
                    self._clip_grad_norm(w.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            # each dp group's mean loss, counted once (by its tp rank 0 on the last pipeline stage)
            if not (self.is_last_stage and self.coord.tp == 0):
                total = torch.zeros((), device=self.device, dtype=torch.float32)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            loss = (total / lay.dp).item()
        self._details = {"breakdown_s": {"forward_backward": fb.seconds, "optimizer": opt.seconds,
                                         "total": step.seconds}}
        return loss

    def _clip_grad_norm(self, max_norm: float) -> None:
        """torch's clip_grad_norm_ over every shard of every stage: the norm of this rank's
        DTensor gradients is reduced over their (dp, tp) mesh by full_tensor(); the pp stages'
        squared norms are summed across the pp dimension."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if self.spec.layout.pp > 1:
            squared = norm.float() ** 2
            dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=self.mesh["pp"].get_group())
            norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)

    # ---------------------------------------------------------------- reporting

    def full_state_dict(self):
        """Every parameter gathered whole (across dp and tp by full_tensor(), a collective of
        each stage's ranks), the stages collected on global rank 0; None elsewhere."""
        keep = self.coord.dp == 0 and self.coord.tp == 0
        mine = {}
        for part in self.parts:
            for name, param in part.named_parameters():
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                if keep:
                    mine[name.replace(_WRAPPED, "")] = full.detach().float().cpu().clone()
        if self.spec.layout.pp > 1:
            gathered = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
            dist.gather_object(mine if keep else {}, gathered, dst=0)
            if self.ctx.rank == 0:
                mine = {k: v for part in gathered for k, v in part.items()}
        return mine if self.ctx.rank == 0 else None

    def last_step_details(self) -> dict:
        """Measured with the device synchronised: the forward and backward of every micro-batch
        (collectives and the pipeline bubble included: FSDP2, DTensor and the schedules do not
        time them apart), the optimizer (clipping with its norm reductions, AdamW, zeroing) and
        the whole step (the rest: the batch slice and the loss all-reduce)."""
        return dict(self._details)

    def describe(self) -> dict:
        from harness.frameworks.native_tp import describe_plan

        lay, w = self.spec.layout, self.spec.workload
        d = {
            "framework": "pytorch native: FSDP2 + DTensor TP/SP + torch.distributed.pipelining",
            "torch_version": torch.__version__,
            "mesh": {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "order": "pp, dp, tp (tp innermost)"},
            "coord": {"pp": self.coord.pp, "dp": self.coord.dp, "tp": self.coord.tp},
            "tensor_parallel": describe_plan(lay.sequence_parallel) if lay.tp > 1 else "none",
            "sequence_parallel": lay.sequence_parallel,
            "pipeline": "none" if self.pipeline is None else {
                "schedule": self.pipeline.name, "micro_batches": self.pipeline.micro, "stages": self.pipeline.table},
            "sharding": "fully_shard over dp per block + root" + (" (per stage module)" if self.pipeline else ""),
            "reshard_after_forward": lay.reshard_after_forward,
            "mixed_precision": ("param bf16, reduce fp32" if w.precision == "bf16" else "none (fp32)"),
            "optimizer": "torch.optim.AdamW" + (" (fused)" if self.device.type == "cuda" else " (foreach)"),
            "grad_clipping": "global norm over dp/tp shards" + (" and pp stages" if lay.pp > 1 else ""),
            "activation_checkpointing": {"none": "none", "full": "torch checkpoint_wrapper per block (non-reentrant)",
                                         "selective": "model's attention-core recomputation (torch checkpoint)"}
            [lay.activation_checkpointing],
            "precision_note": "fp32 throughout, as the reference",
        }
        if w.precision == "bf16":
            d["precision_note"] = ("FSDP2 bf16: parameters gathered and computed in bf16, gradients reduced in fp32, "
                                   "fp32 master weights; the reference runs fp32 weights under torch.autocast(bf16)")
        return d


@torch.no_grad()
def _load_reference_shards(module, reference) -> None:
    """Each parameter's local shard of the reference weights (same full tensor on every rank:
    no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in module.named_parameters():
        full = reference[name.replace(_WRAPPED, "")]
        if isinstance(param, DTensor):
            shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def build(spec, shape, ctx):
    check_world_size(spec, ctx.world_size)  # (1F1B with too few micro-batches: refused by the spec)
    return FSDPEngine(spec, shape, ctx)
