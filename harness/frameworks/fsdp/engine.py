"""engine: fsdp - the same LLaMA under PyTorch's own parallelism, the torchtitan way.

One DeviceMesh (pp, dp, cp, tp), tp innermost (the own engine's rank order, harness/engine/topology.py),
created with init_device_mesh on the existing process group; then, in this order:

  pp  torch.distributed.pipelining: the plain model cut into stage modules of its own pieces,
      PipelineStage per stage, ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B
      (virtual_stages stages per rank) over the mesh's pp dimension (fsdp/pipeline.py);
  tp  DTensor parallelize_module with the Colwise/Rowwise/SequenceParallel plan (fsdp/tp.py);
  ac  `full` wraps every block with torch's checkpoint_wrapper (non-reentrant); `selective` is
      the model's own attention-core recomputation;
  dp  FSDP2 `fully_shard` over the mesh's dp dimension, every block and then the root (the model,
      or each stage module). reshard_after_forward true frees each block's gathered parameters
      after its forward and gathers them again for backward (ZeRO-3-like); false keeps them until
      the backward (ZeRO-2-like). The root is never resharded after forward. Applied at dp=1 too
      (a one-rank group: nothing crosses ranks) so the mixed-precision policy is the same everywhere.
      With cp > 1 it shards over the flattened dp x cp mesh (torchtitan's dp_shard_cp).
  ep  the experts shared out over an ep dimension (dp unflattened into dp_mod_ep x ep, torchtitan's
      dp_shard_mod_ep), dispatched and combined by all_to_all_single, FSDP2 on each layer's experts over
      dp_mod_ep with their gradients divided by dp, before the blocks' (fsdp/experts.py);
  cp  torch.distributed.tensor.experimental.context_parallel around each micro-batch's forward and
      backward (CUDA only: fsdp.py refuses it on CPU): inputs and targets cut into the rank's
      head-tail chunks, which are cp_token_index's (chunks i and 2cp-1-i, in that order), the
      rotary positions those of the same chunks (Llama(cp=, cp_index=)), the loss the rank's
      tokens' mean, averaged over dp x cp by FSDP2's reduce-scatter.

Same as the reference (harness/frameworks/single/engine.py): initial weights (built on the meta device,
sharded, then each rank copies its shard of ReferenceWeights in, one tensor at a time), tokens
(the step's global batch, the contiguous slice of this rank's dp coordinate: every tp rank and
pp stage with the same dp coordinate takes the same rows), loss/len(micro) accumulation
(gradients are reduce-scattered with averaging over dp after every micro-batch, or once after the
last with bf16 accumulation and with pp: see Precision),
torch.optim.AdamW with the workload's hyperparameters (fused on GPU, as the reference), and
global-norm clipping: the norm over every DTensor shard (tp, dp) and over the pp stages (their
squared norms summed across the pp dimension).

Precision: the workload's policy (harness.model.training.PrecisionPolicy), through FSDP2's own
MixedPrecisionPolicy. fp32: none (every tensor and collective fp32). bf16:
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=grad_reduce_dtype): each block's fp32 shards
are cast to bf16, all-gathered and computed with (so the DTensor TP collectives and the pipeline
stage transfers carry bf16 activations and gradients), gradients are reduce-scattered in
grad_reduce_dtype; the fp32 sharded parameters are the optimizer's master copy, and AdamW's
states are fp32 beside them. Micro-batch accumulation follows grad_accum_dtype by where FSDP2
accumulates (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, post_backward;
_fsdp_collectives.py, foreach_reduce; _fsdp_param.py, to_accumulated_grad_if_needed):
  fp32  reduce-scatter after every micro-batch: foreach_reduce casts the reduced shard to the
        parameters' dtype and adds it into the fp32 sharded .grad (FSDP2's default);
  bf16  set_requires_gradient_sync(False) on all but the last micro-batch: the unsharded bf16
        .grad accumulates through autograd, reduced once (only with grad_reduce_dtype bf16:
        without a reduction FSDP2 accumulates in reduce_dtype, so bf16 accumulation with an fp32
        reduction is not offered). With pp, torch.distributed.pipelining always defers the
        reduction to the last micro-batch, so accumulation happens in reduce_dtype: the spec
        refuses pp with differing accumulation and reduction dtypes (fsdp.py, ENGINE.precision_limits).

Memory census (memory_census): what this rank holds at its first optimizer step. FSDP2 reshards
every group after the backward (post_backward, reshard_after_backward), so then only the fp32
sharded parameters (category parameters: they are the module's parameters and, there being no
other copy, the master: master_parameters stays empty), the fp32 sharded gradients (views of one
flat reduce-scatter output per group) and AdamW's states are alive; gathered bf16 parameters and
unsharded accumulation buffers are walked too and counted if alive (they are not, at the step).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from harness.data.source import dp_slice
from harness.frameworks import gather_on_rank0
from harness.frameworks.fsdp.checkpointing import CHECKPOINTING, wrap_blocks
from harness.frameworks.fsdp.experts import ExpertParallel, is_expert
from harness.frameworks.fsdp.gathered import gathered_parameters_are_not_activations
from harness.frameworks.fsdp.grad_norm import global_grad_norm, split_experts
from harness.frameworks.fsdp.muon import fsdp_optimizer, step_comm
from harness.measure import census, ranges, timers
from harness.model import float8
from harness.model.llama import Llama, ReferenceWeights, lm_loss
from harness.model.moe import moe_layers, set_router_losses, take_router_stats
from harness.model.muon import describe as describe_optimizer
from harness.model.training import BuildOptions, StepHooks, dtype_name, precision_policy
from harness.parallel_dims import AXES, ParallelDims
from harness.spec import micro_batches_per_step

_WRAPPED = "_checkpoint_wrapped_module."
MOE = "plain MoEFeedForward, every expert on every rank (ep=1), FSDP2-sharded per block; the reference's router losses"
ROTATE = {"allgather": "allgather", "ring": "alltoall"}  # layout.cp_impl -> torch's set_rotate_method


class FSDPEngine:
    name = "fsdp"
    times_own_communication = False  # breakdown_s: whole phases (forward_backward, optimizer, total)

    def __init__(self, spec, shape, ctx, *, options: BuildOptions | None = None):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if ctx.backend is None:
            raise RuntimeError("engine fsdp needs a process group (run it under a launcher)")
        w, lay = spec.workload, spec.layout
        options, self._grad_norm = options or BuildOptions(), None  # the last step's norm, where clipping computed it
        self.spec, self.ctx, self.device, self.hooks = spec, ctx, ctx.device, options.hooks
        dims = ParallelDims.of(lay)
        self.coord = dims.coord(ctx.rank)
        self.mesh = dims.device_mesh(ctx.device.type)
        self.dims = dims
        if lay.tp > 1:  # lets DTensor reduce the gradient norm over (dp, tp) in one all-reduce, not two
            self.mesh["dp", "tp"]._flatten()
        # FSDP2 shards and averages over dp x cp (torchtitan's dp_shard_cp): cp ranks hold the same weights
        self.shard_mesh = self.mesh["dp", "cp"]._flatten("dp_cp") if lay.cp > 1 else self.mesh["dp"]
        self.experts = ExpertParallel(self.mesh, dims, shape, options.routing) if lay.ep > 1 else None
        self.policy = precision_policy(w)
        mixed = self.policy.master is not None  # fp32: no policy, the parameters are their own master
        self.mp = (
            MixedPrecisionPolicy(param_dtype=self.policy.compute, reduce_dtype=self.policy.grad_reduce)
            if mixed
            else MixedPrecisionPolicy()
        )
        # fp32 accumulation: reduce-scatter every micro-batch into the fp32 sharded gradient;
        # compute-dtype accumulation: in the unsharded .grad, reduced after the last micro-batch
        self.reduce_every_micro_batch = self.policy.grad_accum != self.policy.compute or not mixed
        ckpt = lay.activation_checkpointing
        # Built on the meta device and sharded before any memory is allocated, so no rank ever
        # holds the whole model on the device.
        build = {"kernels": options.kernels_for(lay), "checkpointing": "selective" if ckpt == "selective" else "none"}
        if lay.cp > 1:  # rotary positions of the rank's head-tail chunks (cp_token_index: the same order)
            build.update(cp=lay.cp, cp_index=self.coord.cp)
        self.pipeline = None
        with torch.device("meta"):
            if lay.pp > 1:
                from harness.frameworks.fsdp.pipeline import split_model

                self.parts, plans = split_model(spec, shape, self.coord.pp, **build)
            else:
                self.parts, plans = [Llama(shape, **build)], None
        reference = ReferenceWeights(shape, w.seed)
        for part in self.parts:
            if self.experts is not None:  # this ep rank's experts in place of every expert
                self.experts.swap_in(part)
            # the reference's router losses, scaled as lm_loss is (1 / this rank's micro-batches, FSDP2 averaging
            # over dp): the mean over the global batch's micro-batches, as the reference's
            set_router_losses(part, w.moe_aux_loss_coeff, w.moe_z_loss_coeff, micro_batches_per_step(spec))
            self._parallelize(part)
            options.allocate(part, ctx.device)
            if options.load_weights:  # bf16, fp8: the fp32 shards (the masters) start as the reference's do
                _load_reference_shards(part, reference, self.policy.compute if mixed else None)
        if plans is not None:
            from harness.frameworks.fsdp.pipeline import Pipeline, announce_phases

            self.pipeline = Pipeline(
                self.parts, plans, spec, shape, self.mesh["pp"].get_group(), ctx.device, self.policy.compute
            )
            if type(self.hooks) is not StepHooks:  # someone listens (harness memory); a real run keeps torch's
                for stage in self.pipeline.stages:
                    announce_phases(stage, self.hooks)
        self.is_last_stage = plans is None or any(p.last for p in plans)
        self._precompute_fp8_scales()
        named = [(n, p) for part in self.parts for n, p in part.named_parameters()]
        self.params, self.param_groups = [p for _, p in named], split_experts(named, self.experts is not None)
        # AdamW, or Muon on the blocks' matrices, each gathered whole for Newton-Schulz (fsdp/muon.py)
        self.optimizer = fsdp_optimizer(self.parts, w, options.make_optimizer, fused=ctx.device.type == "cuda")
        self.census = census.CensusAtStep(self.optimizer, self._census_tensors)
        self._details: dict = {}

    def _parallelize(self, part) -> None:
        """TP (when tp > 1), activation checkpointing, compile, then FSDP2 over dp: torchtitan's order."""
        from torch.distributed.fsdp import fully_shard

        from harness.model.compiled import compile_blocks

        lay = self.spec.layout
        if lay.tp > 1:
            from harness.frameworks.fsdp.tp import apply_tensor_parallel

            apply_tensor_parallel(part, self.mesh["tp"], lay.sequence_parallel)
            # with tied embeddings the plan made the embedding (RowwiseParallel) and the head
            # (ColwiseParallel) two DTensors, both Shard(0) over the vocabulary: the same rows, so share one again
            part.tie_weights()
        # fp8: torchao's Float8Linear swapped in before fully_shard (torchtitan's order), on the meta module;
        # fp8_all_gather: its weights become WeightWithDynamicFloat8CastTensor, all-gathered by FSDP2 in FP8
        self.policy.convert_fp8(part, self.device.type, fsdp_all_gather=lay.fp8_all_gather)
        wrap_blocks(part, lay.activation_checkpointing)  # full, selective_op: before fully_shard (checkpointing.py)
        compile_blocks(part.layers.children(), lay.compile)  # before fully_shard, as torchtitan
        dp_mesh = self.shard_mesh
        if self.experts is not None:  # the experts over dp_mod_ep first, so the blocks' fully_shard leaves them out
            self.experts.shard(part, lay.reshard_after_forward, self.mp, self.device.type)
        for block in part.layers.children():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=lay.reshard_after_forward, mp_policy=self.mp)
        fully_shard(part, mesh=dp_mesh, reshard_after_forward=False, mp_policy=self.mp)

    # ---------------------------------------------------------------- training

    def train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        w, lay = self.spec.workload, self.spec.layout
        with timers.StepTimer(self.device) as step:
            local = dp_slice(global_batch, self.coord.dp, lay.dp).to(self.device, non_blocking=True)
            with timers.StepTimer(self.device) as fb, self._gathered_parameters_are_not_activations():
                if self.pipeline is not None:
                    total = self.pipeline.step(local[:, :-1], local[:, 1:])
                else:
                    chunks = local.split(lay.micro_batch_size)
                    total = torch.zeros((), device=self.device, dtype=torch.float32)
                    for i, chunk in enumerate(chunks):
                        if not self.reduce_every_micro_batch:  # accumulate unreduced until the last
                            self.parts[0].set_requires_gradient_sync(i == len(chunks) - 1)
                        inputs, targets = chunk[:, :-1].clone(), chunk[:, 1:].clone()  # cut in place under cp
                        with self._context_parallel(inputs, targets):  # the rank's chunks (cp > 1)
                            self.hooks.forward(f"forward micro-batch {i}")
                            logits = self.parts[0](inputs)
                            loss = lm_loss(logits, targets)  # this rank's tokens' mean; FSDP2 averages over dp x cp
                            self.hooks.forward_end()
                            self.hooks.backward(f"loss and backward micro-batch {i}")
                            loss = loss / len(chunks)
                            loss.backward()
                        total += loss.detach().float()
            self.hooks.optimizer("optimizer step (gradient clipping, AdamW)")
            with timers.StepTimer(self.device) as opt:
                if w.grad_clip > 0:
                    self._clip_grad_norm(w.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self._precompute_fp8_scales()
            # each dp group's mean loss, counted once (by its tp rank 0 on the last pipeline stage)
            if not (self.is_last_stage and self.coord.tp == 0):
                total = torch.zeros((), device=self.device, dtype=torch.float32)
            with ranges.harness_sync():  # the harness's loss for the parity check, not the engine's
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
            loss = total / self.dims.replicas()  # the cp ranks of a sequence hold equal token counts
        self._details = {
            "breakdown_s": {"forward_backward": fb.seconds, "optimizer": opt.seconds, "total": step.seconds}
        }
        self._details.update(step_comm(self.optimizer))  # Muon's gathers of whole matrices, in the optimizer's time
        if self.experts is not None:  # the experts' all-to-alls, in the forward and backward's time
            self._details["comm"] = {**self._details.get("comm", {}), **self.experts.take_comm()}
        return loss

    def _context_parallel(self, inputs, targets):
        """torch's context_parallel over the mesh's cp dimension (torchtitan's way): the inputs and
        targets cut in place into the rank's head-tail chunks (chunks i and 2cp-1-i, cp_token_index's
        order) and F.scaled_dot_product_attention replaced by its K/V exchange for the forward and
        backward inside. Nothing when cp is 1."""
        lay = self.spec.layout
        if lay.cp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(ROTATE[lay.cp_impl])
        return context_parallel(
            self.mesh["cp"], buffers=[inputs, targets], buffer_seq_dims=[1, 1], no_restore_buffers={inputs, targets}
        )

    def grad_norm(self) -> float | None:  # _clip_grad_norm's (None without clipping: FSDP2 computes none)
        return None if self._grad_norm is None else float(self._grad_norm)

    def _clip_grad_norm(self, max_norm: float) -> None:
        """torch's clip_grads_with_norm_ by the global norm over every shard of every stage."""
        pp_group = self.mesh["pp"].get_group() if self.spec.layout.pp > 1 else None
        norm = global_grad_norm(self.param_groups, pp_group, self.experts and self.experts.group)
        self._grad_norm = norm.detach()  # read after the step: no device sync inside it
        for params in self.param_groups:  # [all], or [the rest, the experts]: one mesh each
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)

    # ---------------------------------------------------------------- memory

    def _fsdp_params(self) -> list:
        """Every FSDPParam of this rank (torch's per-parameter FSDP2 state: the sharded fp32
        parameter, its all-gather outputs, unsharded gradient buffers)."""
        from torch.distributed.fsdp import FSDPModule

        out, seen = [], set()  # a group over several modules (ep's experts: fsdp/experts.py) shares one state
        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule) and id(module._get_fsdp_state()) not in seen:
                    state = module._get_fsdp_state()
                    seen.add(id(state))
                    groups = getattr(state, "_fsdp_param_groups", None)
                    if groups is None:  # torch < 2.8: one group per module
                        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
                    out.extend(fp for group in groups for fp in group.fsdp_params)
        return out

    def _precompute_fp8_scales(self) -> None:
        """fp8_all_gather: the FP8 weights' scales for the next all-gather (torchao's precompute, after each
        step as torchtitan calls it, and once at build: the whole weight's amax the first all-gather would take)."""
        if self.spec.layout.fp8_all_gather and self.policy.fp8:
            for part in self.parts:
                float8.precompute_fsdp_scales(part)

    def _census_tensors(self) -> dict:
        """What this rank holds, by census category. parameters: the module's sharded fp32
        parameters (padded shards, as FSDP2 allocates them; they are the optimizer's master, so
        master_parameters has nothing of its own) and any gathered compute-dtype copies still
        allocated; gradients: the sharded gradients and any unsharded gradient FSDP2 keeps
        between micro-batches; optimizer_states: AdamW's. Freed storages weigh nothing."""
        fsdp = self._fsdp_params()
        gathered = [t for fp in fsdp for t in fp.all_gather_outputs]
        unsharded_grads = [fp.unsharded_accumulated_grad for fp in fsdp]
        unsharded_grads += [fp._unsharded_param.grad for fp in fsdp if hasattr(fp, "_unsharded_param")]
        return {
            "parameters": list(self.params) + gathered,
            "gradients": [p.grad for p in self.params] + unsharded_grads,
            "optimizer_states": census.optimizer_state_tensors(self.optimizer),
            "fp8": [t for part in self.parts for t in float8.fsdp_scale_tensors(part)] if self.policy.fp8 else [],
        }

    def memory_census(self) -> dict | None:
        return self.census.result

    def activation_exclusions(self) -> list:
        """The sharded parameters and the gathered (unsharded) parameters FSDP2 has allocated now (none between steps:
        the gathered ones of a step are kept from the counting by _gathered_parameters_are_not_activations)."""
        return list(self.params) + [t for fp in self._fsdp_params() for t in fp.all_gather_outputs]

    def process_groups(self) -> dict:
        # its DeviceMesh's groups are ParallelDims axes' groups, named by their ranks (AxisOf); ep's are declared
        return {} if self.experts is None else self.experts.process_groups()

    def _gathered_parameters_are_not_activations(self):
        return gathered_parameters_are_not_activations(self._fsdp_params)

    # ---------------------------------------------------------------- reporting

    def full_state_dict(self):
        """Every parameter gathered whole (across dp and tp by full_tensor(), a collective of
        each stage's ranks), the stages collected on global rank 0; None elsewhere."""
        keep = self.coord.dp == 0 and self.coord.tp == 0
        mine = {}
        for part in self.parts:
            for name, param in part.named_parameters():
                full = param.full_tensor() if hasattr(param, "full_tensor") else param
                if keep or (self.experts is not None and is_expert(name)):  # every ep rank's experts
                    mine[name.replace(_WRAPPED, "")] = full.detach().float().cpu().clone()
        if self.experts is not None:  # the ep group's experts onto its first rank (dp 0: `keep`'s)
            mine = self.experts.gather(mine, keep)
        if self.spec.layout.pp > 1:  # each stage's part
            mine = gather_on_rank0(mine if keep else None)
        return mine if self.ctx.rank == 0 else None

    def router_stats(self) -> dict:
        """The MoE layers' routing since the last call (take_router_stats): every rank routes its own tokens
        (tp = cp = 1 with MoE), each stage its own layers, so the runner's sum over ranks counts each token once."""
        return {name.replace(_WRAPPED, ""): s for part in self.parts for name, s in take_router_stats(part).items()}

    def last_step_details(self) -> dict:
        """Measured with the device synchronised: the forward and backward of every micro-batch (collectives and the
        pipeline bubble included: FSDP2, DTensor and the schedules do not time them apart), the optimizer (clipping with
        its norm reductions, AdamW, zeroing) and the whole step (the rest: the batch slice and the loss all-reduce)."""
        return dict(self._details)

    def describe(self) -> dict:
        from harness.frameworks.fsdp.tp import describe_plan

        lay = self.spec.layout
        return {
            "framework": "pytorch native: FSDP2 + DTensor TP/SP + torch.distributed.pipelining",
            "torch_version": torch.__version__,
            "mesh": self._named(self.dims.sizes(), "order"),
            "coord": self._named(self.coord._asdict()),
            "context_parallel": "none"
            if lay.cp == 1
            else f"torch context_parallel over cp={lay.cp} (head-tail load balancing, rotate {ROTATE[lay.cp_impl]}); "
            "FSDP2 over dp x cp",
            "tensor_parallel": describe_plan(lay.sequence_parallel) if lay.tp > 1 else "none",
            "sequence_parallel": lay.sequence_parallel,
            "pipeline": "none"
            if self.pipeline is None
            else {"schedule": self.pipeline.name, "micro_batches": self.pipeline.micro, "stages": self.pipeline.table},
            "sharding": "fully_shard over dp per block + root" + (" (per stage module)" if self.pipeline else ""),
            "reshard_after_forward": lay.reshard_after_forward,
            "compile": lay.compile,
            **(
                {"moe": MOE if self.experts is None else self.experts.describe}
                if any(moe_layers(p) for p in self.parts)
                else {}
            ),
            "precision_policy": self.policy.describe(),
            **({"fp8_backend": self.policy.fp8_backend(self.device.type)} if self.policy.fp8 else {}),
            "mixed_precision": self._mixed_precision(),
            "optimizer": describe_optimizer(self.optimizer, self.device.type),
            "grad_clipping": "global norm over dp/tp shards"
            + (" and ep's experts" if lay.ep > 1 else "")
            + (" and pp stages" if lay.pp > 1 else ""),
            "activation_checkpointing": CHECKPOINTING[lay.activation_checkpointing],
        }

    def _named(self, degrees: dict, order: str | None = None) -> dict:
        """The mesh's axes by name (cp only when cp > 1, as records without it read)."""
        axes = [a for a in AXES if a != "cp" or self.spec.layout.cp > 1]
        out = {a: degrees[a] for a in axes}
        if order:
            out[order] = ", ".join(axes) + " (tp innermost)"
        return out

    def _mixed_precision(self) -> str:
        """How FSDP2 was configured to the precision policy, in words."""
        if self.policy.master is None:
            return "no MixedPrecisionPolicy: fp32 parameters, gradients and collectives"
        compute, reduce = dtype_name(self.policy.compute), dtype_name(self.policy.grad_reduce)
        text = (
            f"MixedPrecisionPolicy(param_dtype={compute}, reduce_dtype={reduce}): fp32 shards all-gathered "
            f"in {compute}{' (the FP8 linears in FP8)' if self.spec.layout.fp8_all_gather else ''}, "
            "the fp32 sharded parameters are AdamW's master; "
        )
        if self.pipeline is not None:
            return text + (
                f"torch.distributed.pipelining accumulates the unsharded gradients in {reduce} "
                f"(FSDP2 without gradient sync) and reduce-scatters them after the last micro-batch"
            )
        if self.reduce_every_micro_batch:
            return text + (
                f"gradients reduce-scattered in {reduce} after every micro-batch and accumulated in "
                f"the fp32 sharded gradient"
            )
        return text + (
            f"the unsharded {compute} gradients accumulate over micro-batches "
            f"(set_requires_gradient_sync(False) but on the last) and are reduce-scattered in {reduce} "
            f"after the last"
        )


@torch.no_grad()
def _load_reference_shards(module, reference, through=None) -> None:
    """Each parameter's local shard of the reference weights (same full tensor on every rank: no
    communication), rounded through the compute dtype `through` under a mixed policy: the reference's fp32
    masters are its compute-dtype parameters upcast (harness.model.training.MasterWeights)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in module.named_parameters():
        full = reference[name.replace(_WRAPPED, "")]
        full = full if through is None else full.to(through).to(full.dtype)
        if isinstance(param, DTensor):
            shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
