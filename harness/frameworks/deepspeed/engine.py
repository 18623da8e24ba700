"""engine: deepspeed - the same LLaMA under deepspeed.initialize: ZeRO stage 1, 2 or 3, with
DeepSpeed's AutoTP tensor parallelism when tp > 1, its Ulysses sequence parallelism when cp > 1
(DistributedAttention, harness/frameworks/deepspeed/ulysses.py); pp > 1 runs DeepSpeed's pipeline
engine (harness/frameworks/deepspeed/pipe.py).

What is the same as the reference (harness/frameworks/single/engine.py):
  - initial weights: harness.model.llama.ReferenceWeights(shape, seed), loaded before DeepSpeed
    partitions (ZeRO) or shards (AutoTP) them;
  - tokens: every rank builds the step's global batch and takes its contiguous slice by its
    data-parallel rank (the tp ranks of one group take the same slice; under cp each rank then
    keeps its cp_token_index chunks of every sequence);
  - the loss: lm_loss on logits, averaged over micro-batches (DeepSpeed divides each
    micro-batch's loss by gradient_accumulation_steps) and over data-parallel ranks (gradient
    averaging);
  - AdamW with the workload's hyperparameters, global-norm clipping, constant learning rate.
    On CPU the optimizer is torch.optim.AdamW (`torch_adam`), the reference's own; on GPU it is
    DeepSpeed's FusedAdam, DeepSpeed's best (CPUAdam with optimizer offload).
  - the precision policy (workload.precision, grad_accum_dtype, grad_reduce_dtype): under bf16
    both compute with bf16 parameters and keep fp32 masters and Adam states; DeepSpeed is
    configured to it through bf16.enabled, data_types.grad_accum_dtype, communication_data_type
    and bf16.check_grad_overflow false (deepspeed/config.py), and describe() says how
    (precision_policy: the reference's sentence; precision_config: DeepSpeed's keys and the
    wrapper they chose). Losses agree within ~5e-5 relative (tests/test_census_deepspeed.py).
What differs, and is said in describe():
  - how much each ZeRO stage holds beside the policy's minimum (memory_census(), by category and
    dtype; deepspeed/common.py has the closed forms): e.g. BF16_Optimizer at ZeRO-1 keeps every
    bf16 .grad and an fp32 gradient buffer of the whole model;
  - activation checkpointing `full` uses deepspeed.checkpointing.checkpoint per block;
    `selective` is the model's own attention-core recomputation (DeepSpeed has no such mode).
  - tp > 1: AutoTP shards the block's linears (deepspeed/tp.py); embedding and LM head stay
    replicated, where the own engine shards them by vocabulary.
  - a mixture of experts: DeepSpeed's MoE layer in each block (deepspeed/experts.py), or with
    layout.ds_moe autoep DeepSpeed AutoEP's, built inside deepspeed.initialize (deepspeed/autoep.py);
    both route as the reference and carry the harness's router losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.frameworks import gather_on_rank0
from harness.frameworks.deepspeed.common import DeepSpeedBase, configure_checkpointing, fp32_copy
from harness.measure.ranges import harness_sync

CHECKPOINTING = {
    "none": "none",
    "full": "deepspeed.checkpointing.checkpoint per block",
    "selective": "model's attention-core recomputation (torch checkpoint)",
}


class DeepSpeedEngine(DeepSpeedBase):
    def __init__(self, spec, shape, ctx):
        super().__init__(spec, shape, ctx)
        import deepspeed

        w, lay = spec.workload, spec.layout
        ckpt = lay.activation_checkpointing
        mpu, kernels = None, None
        self.cp, self.cp_index, self.loss_divisor = lay.cp, 0, 1
        self.ep_rank = ctx.rank % lay.ep  # DeepSpeed's expert-parallel groups: consecutive ranks (deepspeed/experts.py)
        if lay.cp > 1:  # Ulysses (deepspeed/ulysses.py); AutoTP and hf are refused with it (deepspeed/facts.py)
            from harness.frameworks.deepspeed.ulysses import loss_divisor, sequence_groups, ulysses_kernels

            mpu = sequence_groups(self.dims, ctx.rank)
            self.cp_index = mpu.get_sequence_parallel_rank()
            kernels = ulysses_kernels(lay, shape, w.seq_len, lay.cp, mpu.get_sequence_parallel_group())
            self.loss_divisor = loss_divisor(self.stage, lay.cp)
        else:
            from harness.frameworks.deepspeed.ulysses import forget_sequence_groups

            forget_sequence_groups()
        if lay.tp > 1:
            from harness.frameworks.deepspeed.tp import add_tp_plan, tp_groups

            add_tp_plan(self.config, lay.model_impl)
            mpu = tp_groups(lay.tp)
        if lay.model_impl == "hf":  # refused by the spec (deepspeed/facts.py)
            from harness.frameworks.deepspeed.hf_llama import build_hf_llama

            model = build_hf_llama(shape, w.seed, lay.attention, device=ctx.device)
        elif self.stage == 3:
            model = self._build_partitioned(shape, lay, "selective" if ckpt == "selective" else "none", mpu, kernels)
            if shape.moe:  # AutoEP (facts.py): it gathers each partitioned block and partitions what it builds
                from harness.frameworks.deepspeed.autoep import hand_over

                hand_over(model)
        else:
            from harness.model.llama import Llama, ReferenceWeights, load_reference

            with torch.device("meta"):
                model = Llama(
                    shape,
                    lay.attention,
                    lay.rmsnorm,
                    "selective" if ckpt == "selective" else "none",
                    kernels=kernels,
                    cp=self.cp,
                    cp_index=self.cp_index,
                )
            reference = ReferenceWeights(shape, w.seed)
            autoep = shape.moe and lay.ds_moe == "autoep"
            if shape.moe and not autoep:  # DeepSpeed's MoE layer in each block (deepspeed/experts.py); tp=cp=pp=1
                from harness.frameworks.deepspeed import experts

                experts.swap_in(model, shape, lay.ep)
                experts.set_losses(
                    model, w.moe_aux_loss_coeff, w.moe_z_loss_coeff, self.config["gradient_accumulation_steps"]
                )
                reference = experts.Renamed(reference, shape, lay.ep, self.ep_rank)
            model = load_reference(model, reference, ctx.device)
            if autoep:  # AutoEP replaces each MoE block inside deepspeed.initialize (deepspeed/autoep.py)
                from harness.frameworks.deepspeed.autoep import hand_over

                hand_over(model)
        # fp8: torchao's Float8Linear swapped in before deepspeed.initialize, which then casts the module to bf16
        # (its Parameters kept) and wraps it; DeepSpeed's optimizer keeps the fp32 masters as under bf16
        self.policy.convert_fp8(model, ctx.device.type)
        if ckpt == "full":
            if lay.model_impl == "hf":
                model.hf.gradient_checkpointing_enable()
                for module in model.hf.modules():
                    if hasattr(module, "_gradient_checkpointing_func"):
                        module._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
            else:  # each block through DeepSpeed's checkpoint
                model.set_checkpointing("full", deepspeed.checkpointing.checkpoint)
        if lay.compile != "none":  # each block in place, before initialize (the spec refuses model_impl hf)
            from harness.model.compiled import compile_blocks

            compile_blocks(model.layers.values(), lay.compile)
        if shape.moe and lay.ds_moe == "layer":  # experts' gradients reduced over their expert-data-parallel group
            from harness.frameworks.deepspeed.experts import optimizer_groups

            parameters = optimizer_groups(model)
        else:  # lazy: under AutoEP DeepSpeed takes them after its replacement, and makes the MoE groups itself
            parameters = model.parameters()
        client = None
        if w.optimizer.name == "muon":  # DeepSpeed's MuonWithAuxAdam over the workload's split (deepspeed/muon.py)
            from harness.frameworks.deepspeed.muon import muon_optimizer

            client = muon_optimizer(model, w)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=parameters, optimizer=client, config=self.config, mpu=mpu
        )
        if shape.moe:
            from deepspeed.utils import groups

            assert dist.get_rank(groups._get_expert_parallel_group(f"ep_size_{lay.ep}")) == self.ep_rank
            if lay.ds_moe == "autoep":
                from harness.frameworks.deepspeed.autoep import tap

                micro = self.config["gradient_accumulation_steps"]
                self.taps = tap(self.engine.module, w.moe_aux_loss_coeff, w.moe_z_loss_coeff, micro)
        self.after_initialize()
        if ckpt == "full":
            configure_checkpointing(self.config, self.engine.mpu)
        # named after initialize: AutoTP (and ZeRO-3 under it) may have replaced parameters
        self.params = list(self.engine.module.named_parameters())
        if lay.tp > 1:
            from deepspeed.utils import groups

            self.dp_rank = groups.get_data_parallel_rank()
            self.tp_rank = groups.get_tensor_model_parallel_rank()
        else:  # the cp ranks of one sequence share its data-parallel coordinate
            self.dp_rank, self.tp_rank = self.dims.coord(ctx.rank).dp, 0

    def _build_partitioned(self, shape, lay, checkpointing: str, mpu, kernels=None):
        """ZeRO-3: construct under deepspeed.zero.Init (each parameter partitioned over the
        data-parallel group as soon as its module exists), then load the reference weights one
        gathered parameter at a time from the group's first rank - no rank ever holds the whole
        model on the device. (With tp > 1 AutoTP gathers each sharded weight once more and cuts
        its shard, which ZeRO-3 partitions again.)"""
        import deepspeed

        from harness.model.llama import Llama, ReferenceWeights

        group = None
        if mpu is not None:  # ZeRO partitions over DeepSpeed's sequence-data-parallel group under Ulysses
            group = mpu.get_sequence_data_parallel_group() if self.cp > 1 else mpu.get_data_parallel_group()
        with deepspeed.zero.Init(config_dict_or_path=self.config, mpu=mpu, data_parallel_group=group):
            model = Llama(
                shape, lay.attention, lay.rmsnorm, checkpointing, kernels=kernels, cp=self.cp, cp_index=self.cp_index
            )
        writer = dist.get_rank(group=group) == 0 if group is not None else self.ctx.rank == 0
        reference = ReferenceWeights(shape, self.spec.workload.seed) if writer else None
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if writer:
                    with torch.no_grad():
                        param.data.copy_(reference[name].to(param.device))
        return model

    # ------------------------------------------------------------------ training

    def train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        from harness.model.llama import lm_loss

        micro = self.local_micro_batches(global_batch, self.dp_rank)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for inputs, targets in micro:
            if self.cp > 1:
                from harness.frameworks.deepspeed.ulysses import rank_tokens

                inputs, targets = rank_tokens(inputs, targets, self.cp, self.cp_index)
            logits = self.engine(inputs)
            loss = lm_loss(logits, targets) / self.loss_divisor
            self.engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            self.engine.step()  # the optimizer steps at the accumulation boundary only
            total += loss.detach().float()
        self.check_step_applied()
        total *= self.loss_divisor / len(micro)  # the mean over this rank's tokens
        # every rank of a tp group holds the same loss, the cp ranks of a sequence equal token
        # counts: the mean over all ranks is the mean over dp
        with harness_sync():  # the harness's loss for the parity check, not the engine's
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.ctx.world_size

    # ------------------------------------------------------------------ inspection

    def full_state_dict(self):
        """fp32 master weights, AutoTP shards put together, on global rank 0 (None elsewhere);
        every rank takes part in the gathers."""
        tp = self.spec.layout.tp > 1
        if tp:
            from harness.frameworks.deepspeed.tp import gather_tp_shards
        keep = self.dp_rank == 0 and self.tp_rank == 0 and self.cp_index == 0
        keep_experts = self.ctx.rank < self.spec.layout.ep  # expert-data-parallel rank 0 of each expert group
        mine = {}
        for name, param in self.params:
            full = fp32_copy(param)
            if tp:
                full = gather_tp_shards(param, full)
            if self.shape.moe:
                if keep_experts if self._moe().is_expert(name) else keep:
                    mine.update(self._plain_entries(name, full))
            elif keep:
                mine[self._plain_name(name)] = full
        return gather_on_rank0(mine or None)

    def router_stats(self) -> dict:
        """The MoE layers' routing since the last call, in take_router_stats' format: every rank routes its
        own tokens (tp = cp = pp = 1 with MoE), so the runner's sum over ranks counts each token once."""
        if self.spec.layout.ds_moe == "autoep":
            from harness.frameworks.deepspeed.autoep import take_stats

            return take_stats(self.taps)
        from harness.frameworks.deepspeed.experts import take_stats

        return take_stats(self.engine.module)

    def process_groups(self) -> dict:
        groups = super().process_groups()
        if self.shape.moe:  # DeepSpeed's expert-parallel and expert-data-parallel groups carry no group_desc
            from harness.frameworks.deepspeed.experts import expert_groups

            moe = expert_groups()
            groups["ep"] = moe["ep"]
            groups["dp"] = groups["dp"] + moe["dp"]
        return groups

    def _moe(self):
        """The module naming this run's MoE parameters: deepspeed/autoep.py or deepspeed/experts.py."""
        from harness.frameworks.deepspeed import autoep, experts

        return autoep if self.spec.layout.ds_moe == "autoep" else experts

    def _plain_entries(self, name: str, full) -> list:
        """The reference's (name, tensor) of a MoE run's parameter (an AutoEP expert tensor holds E/ep experts)."""
        lay = self.spec.layout
        if lay.ds_moe == "autoep":
            return self._moe().plain_entries(name, full, self.shape, lay.ep, self.ep_rank)
        return [(self._moe().plain_name(name, self.shape, lay.ep, self.ep_rank), full)]

    def _plain_name(self, name: str) -> str:
        if self.spec.layout.model_impl == "hf":
            from harness.frameworks.deepspeed.hf_llama import from_hf_name

            return from_hf_name(name[len("hf.") :])
        return name

    def describe(self) -> dict:
        lay = self.spec.layout
        d = self.describe_common()
        d["activation_checkpointing"] = CHECKPOINTING[lay.activation_checkpointing]
        d["compile"] = "torch.compile per block before deepspeed.initialize" if lay.compile != "none" else "none"
        if lay.tp > 1:
            from harness.frameworks.deepspeed.tp import SHARDED, sharded_names

            d["tensor_parallel"] = f"DeepSpeed AutoTP training, autotp_size {lay.tp}: {SHARDED}"
            d["autotp_sharded_parameters"] = len(sharded_names(self.params))
        if self.shape.moe:
            moe = self._moe()
            d["moe"] = f"{moe.SETTINGS}, ep_size {lay.ep}; ZeRO with MoE parameter groups"
            d["moe_losses"] = moe.LOSSES
        if lay.cp > 1:
            from harness.frameworks.deepspeed.ulysses import describe_ulysses

            d["context_parallel"] = describe_ulysses(lay, self.loss_divisor)
        return d
