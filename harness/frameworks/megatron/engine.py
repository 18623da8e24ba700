"""engine: megatron - Megatron-core's own GPTModel, parallel_state, schedules, DDP and optimizers.

Megatron-core (megatron-core 0.16 before Python 3.12, 0.19 from it: pyproject; its local layer spec, no
Transformer Engine) on the workload:

  parallel_state.initialize_model_parallel(tp, pp, vp, ep), order tp-cp-ep-dp-pp: tp innermost, then dp,
      then pp, the harness's rank order (harness/parallel_dims.py; checked against it at build, and the
      expert-parallel rank against ParallelDims.expert_index: ep carved from dp as the harness carves it);
  GPTModel per model chunk (virtual_stages chunks per pipeline rank under the interleaved schedule), built
      from megatron/layer_spec.py (TransformerConfig as the workload's LLaMA, the local spec with our RMSNorm);
  Float16Module under bf16; DistributedDataParallel around each chunk (no overlap; the main gradients in
      its contiguous buffer), with use_distributed_optimizer for zero_stage 1;
  get_forward_backward_func(): forward_backward_no_pipelining, the 1F1B schedule or the interleaved one,
      with finalize_model_grads (the DP reduction, SP norms' tp all-reduce, tied embeddings' pp all-reduce);
  get_megatron_optimizer: torch.optim.AdamW (Megatron's fallback without TE/Apex) inside FP32Optimizer,
      Float16OptimizerWithFloat16Params (bf16, ZeRO-0) or DistributedOptimizer (ZeRO-1); it clips by the
      global norm over every rank (Megatron's clip_grad_norm_fp32) before the step; with ep > 1 a second
      one for the experts' parameters over the expert-data-parallel group (Megatron's ChainedOptimizer);
  a MoE model: Megatron's MoELayer (layer_spec.moe_config), its routing read by megatron/routers.py.

The same workload as the reference (single/engine.py): the reference weights mapped into each rank's
parameters (megatron/weights.py), over Megatron's own initialisation;
the tokens (every rank takes the step's global batch, its dp coordinate's contiguous rows, micro-batches of
micro_batch_size in order); the loss, each micro-batch's token mean, divided by the micro-batch count by
Megatron's schedule and averaged over dp by its DDP: the global token mean; AdamW with the workload's
lr, betas, eps and weight decay on every parameter (config_overrides={}: Megatron's default would exempt
biases and norms, the reference exempts nothing); clipping at workload.grad_clip. Precision: fp32 is fp32
throughout; bf16 is Megatron's bf16 (bf16 parameters, main gradients in the DDP buffer in
grad_reduce_dtype: grad_reduce_in_fp32, fp32 master parameters and Adam states).

On CPU every call into Megatron runs inside megatron_shim.active() (its few hard-coded CUDA calls answered
by the CPU); on a GPU there is no shim.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch
import torch.distributed as dist

from harness.data.source import dp_slice, micro_batches
from harness.errors import NonFiniteStep
from harness.frameworks import gather_on_rank0
from harness.frameworks.megatron import shim as megatron_shim
from harness.frameworks.megatron import weights as megatron_weights
from harness.frameworks.megatron.routers import RouterTaps
from harness.measure.census import CensusAtStep, optimizer_state_tensors
from harness.measure.ranges import harness_sync
from harness.measure.timers import StepTimer
from harness.model.llama import ReferenceWeights
from harness.model.training import precision_policy
from harness.parallel_dims import ParallelDims

VERSION = importlib.metadata.version("megatron-core")


class MegatronEngine:
    name = "megatron"
    times_own_communication = False  # breakdown_s: whole phases (forward_backward, optimizer, total)

    def __init__(self, spec, shape, ctx):
        if ctx.backend is None:
            raise RuntimeError("engine megatron needs a process group (run it under a launcher)")
        self.spec, self.shape, self.ctx, self.device = spec, shape, ctx, ctx.device
        self._grad_norm = None  # the last step's, from Megatron's optimizer
        self.shimmed = ctx.device.type != "cuda"
        self.policy = precision_policy(spec.workload)
        self.coord = ParallelDims.of(spec.layout).coord(ctx.rank)
        cpu_rng = torch.get_rng_state()  # Megatron's CPU initialisation and RNG tracker draw from it
        with self._megatron():
            self._build()
        torch.set_rng_state(cpu_rng)
        self.census = CensusAtStep(self.torch_optimizer, self._census_tensors)
        self._details: dict = {}

    def _megatron(self):
        return megatron_shim.active() if self.shimmed else contextlib.nullcontext()

    # ---------------------------------------------------------------- build

    def _build(self) -> None:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.module import Float16Module

        from harness.frameworks.megatron.layer_spec import block_spec, transformer_config

        w, lay, shape = self.spec.workload, self.spec.layout, self.shape
        self.vp = lay.virtual_stages if lay.pipeline_schedule == "interleaved" and lay.pp > 1 else 1
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            lay.tp,
            lay.pp,
            self.vp if self.vp > 1 else None,
            expert_model_parallel_size=lay.ep,
            expert_tensor_parallel_size=lay.tp,  # Megatron's default (layer_spec.moe_config)
        )
        megatron_coord = {
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "cp": parallel_state.get_context_parallel_rank(),
            "tp": parallel_state.get_tensor_model_parallel_rank(),
        }
        if megatron_coord != self.coord._asdict():
            raise RuntimeError(
                f"rank {self.ctx.rank}: Megatron's coordinates {megatron_coord} differ from the "
                f"harness's {self.coord._asdict()}"
            )
        dims = ParallelDims.of(lay)
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        if self.ep_rank != dims.expert_index(self.ctx.rank):
            raise RuntimeError(
                f"rank {self.ctx.rank}: Megatron's expert-parallel rank {self.ep_rank} differs from the "
                f"harness's {dims.expert_index(self.ctx.rank)}"
            )
        tensor_parallel.model_parallel_cuda_manual_seed(w.seed)

        compute = self.policy.compute
        self.config = config = transformer_config(
            shape, self.spec, lay.tp, lay.pp, self.vp, compute, deallocate=self.ctx.backend == "nccl"
        )
        reduce_fp32 = self.policy.grad_reduce == torch.float32
        # Megatron-LM's defaults: no overlap, so one bucket per buffer (Megatron drops bucket_size then: the
        # own engine's dp_bucket_mb has no counterpart here)
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=reduce_fp32,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=lay.zero_stage == 1,
        )
        reference = ReferenceWeights(shape, w.seed)
        self.chunks = []
        for v in range(self.vp):
            stage = v if self.vp > 1 else None
            model = GPTModel(
                config,
                block_spec(config, shape.attention_bias, stage),
                vocab_size=shape.vocab,
                max_sequence_length=w.seq_len,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=shape.tie_embeddings,
                position_embedding_type="rope",
                rotary_base=shape.rope_theta,
                rope_scaling=shape.rope_scaling is not None,
                rope_scaling_factor=shape.rope_scaling[0] if shape.rope_scaling else 8.0,
                vp_stage=stage,
            )
            self._load(model, reference)
            model.to(self.device)  # built on the CPU (use_cpu_initialization); Megatron-LM's get_model: .cuda()
            if compute != torch.float32:
                model = Float16Module(config, model)
            # Megatron-LM's get_model: every chunk after the first in one bucket group
            self.chunks.append(DistributedDataParallel(config, self.ddp_config, model, disable_bucketing=v > 0))
        config.finalize_model_grads_func = finalize_model_grads
        self.opt_config = OptimizerConfig(
            optimizer="adam",
            lr=w.optimizer.lr,
            min_lr=w.optimizer.lr,
            weight_decay=w.optimizer.weight_decay,
            adam_beta1=w.optimizer.betas[0],
            adam_beta2=w.optimizer.betas[1],
            adam_eps=w.optimizer.eps,
            clip_grad=w.grad_clip,
            bf16=compute == torch.bfloat16,
            params_dtype=compute,
            use_distributed_optimizer=lay.zero_stage == 1,
            decoupled_weight_decay=True,
        )
        self.optimizer = get_megatron_optimizer(self.opt_config, self.chunks, config_overrides={})
        # a ChainedOptimizer of FP32Optimizer, Float16OptimizerWithFloat16Params or DistributedOptimizer around
        # torch's AdamW: one for the dense parameters, and with ep > 1 one for the experts' (over the
        # expert-data-parallel group); it steps them in this order
        self.megatron_optimizers = list(self.optimizer.chained_optimizers)
        self.megatron_optimizer = self.megatron_optimizers[0]
        self.torch_optimizer = self.megatron_optimizers[-1].optimizer  # the last to step (the census)
        self.forward_backward = get_forward_backward_func()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.routers = RouterTaps(
            [self._gpt(c) for c in self.chunks], shape, parallel_state.get_tensor_model_parallel_group()
        )

    def _gpt(self, chunk):
        """The GPTModel inside a chunk's DDP (and Float16Module) wrappers."""
        while hasattr(chunk, "module"):
            chunk = chunk.module
        return chunk

    @property
    def _first_expert(self) -> int:
        """The global index of this rank's local expert 0."""
        return self.ep_rank * (self.shape.experts // self.spec.layout.ep) if self.shape.moe else 0

    def _layer_numbers(self, gpt) -> dict[int, int]:
        return {j: layer.layer_number for j, layer in enumerate(gpt.decoder.layers)}

    @torch.no_grad()
    def _load(self, gpt, reference) -> None:
        """This rank's part of the reference weights into a freshly built GPTModel chunk."""
        numbers, tied = self._layer_numbers(gpt), self.shape.tie_embeddings
        tp, rank = self.spec.layout.tp, self.coord.tp
        for name, param in gpt.named_parameters():
            plain = [reference[n] for n in megatron_weights.plain_names(name, numbers, tied, self._first_expert)]
            param.copy_(megatron_weights.megatron_shard(name, plain, self.shape, tp, rank))

    # ---------------------------------------------------------------- step

    def train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        with self._megatron():
            return self._train_step(global_batch)

    def _train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        w, lay = self.spec.workload, self.spec.layout
        with StepTimer(self.device) as step:
            local = dp_slice(global_batch, self.coord.dp, lay.dp).to(self.device, non_blocking=True)
            micro = micro_batches(local, lay.micro_batch_size)
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            iterators = [iter(micro) for _ in self.chunks]
            with StepTimer(self.device) as fb:
                reduced = self.forward_backward(
                    forward_step_func=_forward_step,
                    data_iterator=iterators if self.vp > 1 else iterators[0],
                    model=self.chunks,
                    num_microbatches=len(micro),
                    seq_length=w.seq_len,
                    micro_batch_size=lay.micro_batch_size,
                    forward_only=False,
                )
            with StepTimer(self.device) as opt:
                ok, self._grad_norm, _ = self.optimizer.step()
            if not ok:
                raise NonFiniteStep("Megatron's optimizer skipped the step (non-finite gradients)")
            self.routers.step_done()
            # each dp group's mean loss, counted once (by its tp rank 0 on the last pipeline stage)
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            if self.is_last_stage and self.coord.tp == 0:
                total += sum(float(r["loss"]) for r in reduced) / len(micro)
            with harness_sync():  # the harness's loss for the parity check, not the engine's
                dist.all_reduce(total)
            loss = total / lay.dp
        self._details = {
            "breakdown_s": {"forward_backward": fb.seconds, "optimizer": opt.seconds, "total": step.seconds}
        }
        return loss

    # ---------------------------------------------------------------- memory

    def _buffers(self) -> list:
        return [b for chunk in self.chunks for b in chunk.buffers]

    def _model_params(self) -> list:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def _masters(self) -> list:
        """The optimizer's fp32 copies that are not the model's parameters (bf16: Float16Optimizer's
        fp32_from_float16_groups, or the DistributedOptimizer's fp32 shards; fp32: none of their own)."""
        out = []
        for opt in self.megatron_optimizers:
            groups = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(
                opt, "fp32_from_float16_groups", []
            )
            shards = getattr(opt, "shard_fp32_groups", [])  # ZeRO-1 fp32: views of the parameters' buffer
            out += [t for g in list(groups) + list(shards) for t in g]
        return out

    def _census_tensors(self) -> dict:
        """What this rank holds, by census category: the parameters (with ZeRO-1 the DDP's contiguous
        param buffer they are views of), the main gradients (the DDP's grad buffer, and any .grad or
        main_grad outside it), the master parameters and AdamW's states."""
        buffers, params = self._buffers(), self._model_params()
        return {
            "parameters": [b.param_data for b in buffers if b.param_data is not None] + params,
            "gradients": [b.grad_data for b in buffers]
            + [getattr(p, "main_grad", None) for p in params]
            + [p.grad for p in params]
            + [m.grad for m in self._masters()],
            "master_parameters": self._masters(),
            "optimizer_states": [t for opt in self.megatron_optimizers for t in optimizer_state_tensors(opt.optimizer)],
        }

    def memory_census(self) -> dict | None:
        return self.census.result

    def activation_exclusions(self) -> list:
        return self._model_params() + [b.param_data for b in self._buffers() if b.param_data is not None]

    def process_groups(self) -> dict:
        return {}  # none: parallel_state's groups name themselves (group_desc, profiling.annotate.GROUP_DESC)

    # ---------------------------------------------------------------- reporting

    def full_state_dict(self):
        with self._megatron():
            return self._full_state_dict()

    def _full_state_dict(self):
        """Every parameter whole, named as the plain Llama's, on global rank 0 (None elsewhere): under
        bf16 the fp32 masters (the reference's), gathered over dp from a DistributedOptimizer's shards;
        tp parts all-gathered, the pp stages' and the expert-parallel ranks' experts collected on rank 0."""
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        masters = self._master_of_each_param()
        lay = self.spec.layout
        keep = self.coord.dp == 0 and self.coord.tp == 0
        # each expert's keeper: tp rank 0 of the first of the ranks that hold it (expert-data-parallel rank 0)
        keep_experts = self.coord.tp == 0 and (lay.ep == 1 or parallel_state.get_expert_data_parallel_rank() == 0)
        mine = {}
        for chunk in self.chunks:
            gpt = self._gpt(chunk)
            numbers = self._layer_numbers(gpt)
            for name, param in gpt.named_parameters():
                if getattr(param, "shared", False):  # the last stage's copy of a tied embedding
                    continue
                value = masters.get(id(param), param.detach().float())
                if getattr(param, "tensor_model_parallel", False) and lay.tp > 1:  # experts: expert tp = tp
                    shards = [torch.empty_like(value) for _ in range(lay.tp)]
                    dist.all_gather(shards, value.contiguous(), group=tp_group)
                else:
                    shards = [value]
                if keep_experts if megatron_weights.is_expert(name) else keep:
                    names = megatron_weights.plain_names(name, numbers, self.shape.tie_embeddings, self._first_expert)
                    tensors = megatron_weights.plain_tensors(name, shards, self.shape)
                    for plain, tensor in zip(names, tensors, strict=True):
                        mine[plain] = tensor.detach().float().cpu().clone()
        if lay.pp > 1 or lay.ep > 1:  # each stage's part, each expert-parallel rank's experts
            mine = gather_on_rank0(mine or None)
        return mine if self.ctx.rank == 0 else None

    def _master_of_each_param(self) -> dict[int, torch.Tensor]:
        """id(model parameter) -> its whole fp32 master, where the optimizer keeps one apart (bf16)."""
        from megatron.core import parallel_state

        if self.policy.master is None:
            return {}
        out = {}
        for opt in self.megatron_optimizers:
            if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer: a shard per dp rank
                groups = zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True)
                shards = {id(p): s for g_model, g_shard in groups for p, s in zip(g_model, g_shard, strict=True)}
                expert = opt is not self.megatron_optimizer  # the experts' optimizer (ep > 1)
                group = (
                    parallel_state.get_expert_data_parallel_group()
                    if expert
                    else parallel_state.get_data_parallel_group()
                )
                # the same order on every rank of the group; a rank fills its part
                for param in self._model_params():
                    if getattr(param, "allreduce", True) == expert:
                        continue
                    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
                    if id(param) in shards:
                        where = opt._get_model_param_range_map(param)["param"]
                        full[where.start : where.end] = shards[id(param)]
                    dist.all_reduce(full, group=group)
                    out[id(param)] = full.view(param.shape)
            else:
                groups = zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True)
                out.update(
                    {id(p): m.detach() for g_model, g_main in groups for p, m in zip(g_model, g_main, strict=True)}
                )
        return out

    def _describe_moe(self) -> dict:
        if not self.shape.moe:
            return {}
        c = self.config
        return {
            "moe": f"MoELayer: TopKRouter (top-{c.moe_router_topk} of {c.num_moe_experts}, softmax, "
            f"pre_softmax={c.moe_router_pre_softmax}, router fp32, dropless), alltoall token dispatcher, "
            "SequentialMLP experts (no grouped GEMM: neither grouped_gemm nor Transformer Engine here), "
            f"expert_model_parallel_size={self.spec.layout.ep}, expert_tensor_parallel_size={self.spec.layout.tp}, "
            f"aux_loss coeff {c.moe_aux_loss_coeff:g}, z-loss coeff {c.moe_z_loss_coeff or 0:g}"
        }

    def router_stats(self) -> dict:
        """Each MoE layer's routing since the last call, in the harness's format (megatron/routers.py)."""
        return self.routers.take()

    def grad_norm(self) -> float | None:
        """The global norm Megatron's optimizer step returned (clip_grad_norm_fp32 over every rank)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def last_step_details(self) -> dict:
        """Measured with the device synchronised: Megatron's forward_backward_func (every micro-batch's
        forward and backward, its pipeline transfers and bubble, finalize_model_grads' reductions), its
        optimizer step (the norm, clipping, AdamW, a DistributedOptimizer's parameter all-gather), the step."""
        return dict(self._details)

    def describe(self) -> dict:
        lay = self.spec.layout
        where = (
            "on CPU through the device shim (harness/frameworks/megatron/shim.py)"
            if self.shimmed
            else f"on {self.device.type.upper()}"
        )
        return {
            "framework": f"megatron-core {VERSION} {where}",
            "megatron_core_version": VERSION,
            "device_shim": self.shimmed,
            "torch_version": torch.__version__,
            "mesh": {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "ep": lay.ep, "order": "tp-cp-ep-dp-pp (tp innermost)"},
            "coord": {"pp": self.coord.pp, "dp": self.coord.dp, "tp": self.coord.tp},
            "layer_spec": "local (no Transformer Engine): ColumnParallelLinear/RowParallelLinear, DotProductAttention, "
            "SwiGLU MLP; the harness's RMSNorm",
            "vocab_padding": "none",
            **self._describe_moe(),
            "sequence_parallel": lay.sequence_parallel,
            "schedule": self.forward_backward.__name__,
            "virtual_stages": self.vp,
            "ddp": f"DistributedDataParallel(grad_reduce_in_fp32={self.ddp_config.grad_reduce_in_fp32}, "
            f"use_distributed_optimizer={self.ddp_config.use_distributed_optimizer}, "
            "overlap_grad_reduce=False: one bucket per buffer)",
            "optimizer": f"{type(self.megatron_optimizer).__name__} over {type(self.torch_optimizer).__name__} "
            "(weight decay on every parameter)",
            "grad_clipping": f"Megatron's global norm over every rank, max {self.spec.workload.grad_clip:g}",
            "activation_checkpointing": {
                "none": "none",
                "full": "recompute_granularity=full, uniform, 1 layer per checkpoint",
                "selective": "recompute_granularity=selective, core_attn",
            }[lay.activation_checkpointing],
            "precision_policy": self.policy.describe(),
        }


def _forward_step(data_iterator, model):
    """Megatron's forward_step_func: one micro-batch through the chunk; its loss the token mean."""
    inputs, targets = next(data_iterator)
    output = model(inputs, None, None, labels=targets)
    return output, _loss


def _loss(per_token):
    loss = per_token.float().mean()
    return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place
