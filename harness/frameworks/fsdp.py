"""engine: fsdp - the same LLaMA under PyTorch FSDP2 (`fully_shard`).

`fully_shard` is applied to every transformer block and then to the root (embedding, final
norm and LM head stay in the root's group). reshard_after_forward true frees each block's
gathered parameters after its forward and gathers them again for backward (ZeRO-3-like);
false keeps them until the backward (ZeRO-2-like: more memory, one all-gather fewer). The
root is never resharded after forward (its parameters are needed right away in backward).

Same as the reference (harness/frameworks/single.py): initial weights (the plain model is
built one tensor at a time from ReferenceWeights and sharded), tokens (contiguous dp slice of the step's
global batch), loss/len(micro) accumulation (gradients are reduce-scattered with averaging
over ranks after every micro-batch), torch.optim.AdamW with the workload's hyperparameters
(fused on GPU, as the reference), global-norm clipping over the sharded gradients.

Precision: fp32 workloads use no MixedPrecisionPolicy. bf16 uses
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): parameters are all-gathered and
computed in bf16, gradients reduced in fp32, fp32 sharded master weights and optimizer state.
The reference instead runs fp32 weights under torch.autocast(bf16) (norms and the softmax
stay fp32 there), so bf16 losses differ slightly; describe() says so.

Activation checkpointing: `full` wraps every block with torch's checkpoint_wrapper (non-
reentrant) before sharding; `selective` is the model's own attention-core recomputation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.data.source import dp_slice
from harness.model.training import make_adamw
from harness.model.llama import Llama, ReferenceWeights, lm_loss

_WRAPPED = "_checkpoint_wrapped_module."


class FSDPEngine:
    name = "fsdp"

    def __init__(self, spec, shape, ctx):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if ctx.backend is None:
            raise RuntimeError("engine fsdp needs a process group (run it under a launcher)")
        w, lay = spec.workload, spec.layout
        self.spec, self.ctx, self.device = spec, ctx, ctx.device
        ckpt = lay.activation_checkpointing
        # Built on the meta device and sharded before any memory is allocated, so no rank ever
        # holds the whole model on the device; each rank then copies its shard of the reference
        # weights in (harness/model/llama.py: ReferenceWeights, fp32, CPU, one tensor at a time).
        with torch.device("meta"):
            model = Llama(shape, lay.attention, lay.rmsnorm, "selective" if ckpt == "selective" else "none")
        if ckpt == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl, checkpoint_wrapper)

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        self.mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        if w.precision == "bf16":
            self.mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            self.mp = MixedPrecisionPolicy()
        for block in model.layers:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=lay.reshard_after_forward, mp_policy=self.mp)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=False, mp_policy=self.mp)
        model.to_empty(device=ctx.device)
        self._load_reference_shards(model, ReferenceWeights(shape, w.seed))
        self.model = model
        self.optimizer = make_adamw(model.parameters(), w, fused=ctx.device.type == "cuda")
        self._details: dict = {}

    @staticmethod
    @torch.no_grad()
    def _load_reference_shards(model, reference: dict) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        for name, param in model.named_parameters():
            full = reference[name.replace(_WRAPPED, "")]
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank holds the same full tensor, no communication
                shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements,
                                          src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)

    def train_step(self, global_batch: torch.Tensor) -> float:
        w, lay = self.spec.workload, self.spec.layout
        local = dp_slice(global_batch, self.ctx.rank, self.ctx.world_size).to(self.device, non_blocking=True)
        chunks = local.split(lay.micro_batch_size)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for chunk in chunks:
            logits = self.model(chunk[:, :-1])
            loss = lm_loss(logits, chunk[:, 1:]) / len(chunks)
            loss.backward()
            total += loss.detach().float()
        if w.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), w.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return (total / self.ctx.world_size).item()

    def full_state_dict(self):
        out = {}
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param  # collective
            if self.ctx.rank == 0:
                out[name.replace(_WRAPPED, "")] = full.detach().float().cpu().clone()
        return out if self.ctx.rank == 0 else None

    def last_step_details(self) -> dict:
        return dict(self._details)

    def describe(self) -> dict:
        lay, w = self.spec.layout, self.spec.workload
        return {
            "framework": "fsdp2",
            "torch_version": torch.__version__,
            "sharding": "fully_shard per block + root",
            "reshard_after_forward": lay.reshard_after_forward,
            "mixed_precision": ("param bf16, reduce fp32" if w.precision == "bf16" else "none (fp32)"),
            "optimizer": "torch.optim.AdamW" + (" (fused)" if self.device.type == "cuda" else " (foreach)"),
            "activation_checkpointing": {"none": "none", "full": "torch checkpoint_wrapper per block (non-reentrant)",
                                         "selective": "model's attention-core recomputation (torch checkpoint)"}
            [lay.activation_checkpointing],
            "precision_note": ("FSDP2 bf16: parameters gathered and computed in bf16, gradients reduced in fp32, "
                               "fp32 master weights; the reference runs fp32 weights under torch.autocast(bf16)"
                               if w.precision == "bf16" else "fp32 throughout, as the reference"),
        }


def build(spec, shape, ctx):
    if spec.layout.tp > 1 or spec.layout.pp > 1:  # until DTensor TP/SP and pipelining are wired in
        from harness.errors import SpecError

        raise SpecError("layout.tp" if spec.layout.tp > 1 else "layout.pp", "not built yet for engine fsdp")
    return FSDPEngine(spec, shape, ctx)
