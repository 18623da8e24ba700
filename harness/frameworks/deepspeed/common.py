"""What both DeepSpeed engines share (engine.py: ZeRO with AutoTP; pipe.py: the
pipeline engine): the config, DeepSpeed's communication on the harness's process group, this
rank's micro-batches, the weights gathered on rank 0, the memory census, the check that no step
was skipped, and the common part of describe().

The precision policy (harness.model.training.PrecisionPolicy) reaches DeepSpeed through its
config (deepspeed/config.py): bf16.enabled, data_types.grad_accum_dtype, communication_data_type and
bf16.check_grad_overflow false. What DeepSpeed 0.19.8 then holds on a rank under bf16 (P
parameters, d data-parallel ranks; read from runtime/zero/stage_1_and_2.py, bf16_optimizer.py,
zero/stage3.py):
  ZeRO-1, grad_accum fp32: BF16_Optimizer - flat bf16 parameters (2P), the bf16 .grad of every
      parameter (2P, zeroed by backward_prologue, never freed), an fp32 gradient buffer of the
      whole model (4P, all-reduced in communication_data_type), fp32 master partition 4P/d,
      Adam 8P/d;
  ZeRO-1/2, grad_accum bf16, and ZeRO-2 fp32: DeepSpeedZeroOptimizer - flat bf16 parameters
      2P, at the step the master partition's fp32 gradient (4P/d; ZeRO-1 keeps the bf16 .grad
      of the partition's parameters until then), fp32 master partition 4P/d, Adam 8P/d;
  ZeRO-3: DeepSpeedZeroOptimizer_Stage3 - bf16 partitions 2P/d (parameters under
      stage3_param_persistence_threshold stay whole), a gradient partition buffer in
      grad_accum_dtype (P/d elements), the master's fp32 gradient (4P/d), fp32 master 4P/d,
      Adam 8P/d; and, a census category of its own (buffers), the reduce bucket
      (reduce_bucket_size elements of communication_data_type, held from init).
tests/test_census_deepspeed.py checks these closed forms against the census.
"""

from __future__ import annotations

import torch

from harness.data.source import dp_slice, micro_batches
from harness.errors import NonFiniteStep
from harness.frameworks.deepspeed.config import build_config
from harness.measure.census import CensusAtStep, optimizer_state_tensors
from harness.model.training import precision_policy
from harness.parallel_dims import ParallelDims

# Where DeepSpeed's optimizer wrappers keep what they hold (attributes of BF16_Optimizer,
# DeepSpeedZeroOptimizer (ZeRO-1/2) and DeepSpeedZeroOptimizer_Stage3), by census category.
_WRAPPER_PARAMETERS = ("bf16_groups_flat", "bit16_groups_flat", "lp_param_buffer")
_WRAPPER_GRADIENTS = (
    "fp32_groups_gradients_flat",  # BF16_Optimizer
    "averaged_gradients",
    "all_grad_tensors",
    "grads_in_partition",  # ZeRO-1/2
    "grad_partitions_flat_buffer",
)  # ZeRO-3
_WRAPPER_MASTERS = ("fp32_groups_flat_partition", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def _tensors(*objs):
    """Every tensor in tensors, lists, tuples and dicts of them (None skipped); a ZeRO-1/2
    GradPartitionBufferGroup (a list of views) also gives its flat partition."""
    for x in objs:
        if x is None:
            continue
        if torch.is_tensor(x):
            yield x
            continue
        flat = getattr(x, "flat_partition", None)
        if torch.is_tensor(flat):
            yield flat
        if isinstance(x, dict):
            yield from _tensors(*x.values())
        elif isinstance(x, (list, tuple)):
            yield from _tensors(*x)


def _quiet_deepspeed() -> None:
    import logging

    try:
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    except Exception:  # noqa: BLE001 - logging only
        pass


def _init_deepspeed_comm(ctx) -> None:
    """Make DeepSpeed use the process group harness.runtime.init already created."""
    import deepspeed

    from harness.frameworks.deepspeed.extensions import announce_build

    if ctx.backend is None:
        raise RuntimeError("engine deepspeed needs a process group (run it under a launcher)")
    with announce_build(ctx):  # the op it compiles on CPU, said on the console
        deepspeed.init_distributed(dist_backend=ctx.backend, dist_init_required=False)


def configure_checkpointing(config: dict, mpu) -> None:
    """deepspeed.checkpointing for this engine: the knobs of the config's activation_checkpointing
    section, with the engine's tensor-parallel unit (AutoTP's groups) or None. The knobs are
    passed one by one: configure(deepspeed_config=...) re-checks the batch sizes against the
    whole world, which is wrong once tp or pp > 1."""
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

    ac = DeepSpeedActivationCheckpointingConfig(config)
    checkpointing.mpu = mpu  # configure(None) would keep a previous engine's unit in this process
    checkpointing.configure(
        mpu,
        partition_activations=ac.partition_activations,
        contiguous_checkpointing=ac.contiguous_memory_optimization,
        num_checkpoints=ac.number_checkpoints,
        checkpoint_in_cpu=ac.cpu_checkpointing,
        synchronize=ac.synchronize_checkpoint_boundary,
        profile=ac.profile,
    )


def fp32_copy(param) -> torch.Tensor:
    """The parameter's fp32 master value as ZeRO holds it (gathered over the data-parallel group;
    collective for ZeRO-managed parameters), or the parameter itself when no ZeRO optimizer
    manages it (ZeRO-0)."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = safe_get_full_fp32_param(param)
    if full is None:
        full = param.detach()
    return full.detach().float().cpu().clone()


class DeepSpeedBase:
    """The config and process setup of one DeepSpeed run (dp = world / (tp x cp x pp))."""

    name = "deepspeed"
    times_own_communication = False  # no breakdown at all (last_step_details)

    def __init__(self, spec, shape, ctx):
        lay = spec.layout
        self.spec, self.shape, self.ctx, self.device = spec, shape, ctx, ctx.device
        self.dims = ParallelDims.derive(ctx.world_size, "layout", tp=lay.tp, pp=lay.pp, cp=lay.cp)
        self.dp = self.dims.dp
        # the config is checked first: a contradiction is a SpecError before DeepSpeed loads
        self.config, self.config_file, self.filled = build_config(spec, shape, dp=self.dp, device_type=ctx.device.type)
        _quiet_deepspeed()
        self.stage = self.config["zero_optimization"]["stage"]
        self.policy = precision_policy(spec.workload)
        _init_deepspeed_comm(ctx)
        self.engine = self.optimizer = None  # set by the engine built on this
        self.census = None

    def after_initialize(self) -> None:
        """Once deepspeed.initialize has built self.engine: the census at the first step of the
        torch optimizer that updates this rank's fp32 masters (DeepSpeed's basic optimizer,
        inside its wrapper, which steps it once per parameter group at ZeRO-1/2, a MoE's expert
        groups being groups of their own, and once per sub-group at ZeRO-3: stage3.py,
        _optimizer_step over fp32_partitioned_groups_flat), and the count of skipped steps so far."""
        basic = self.engine.basic_optimizer
        calls = len(getattr(self.optimizer, "fp32_partitioned_groups_flat", None) or basic.param_groups)
        self.census = CensusAtStep(basic, self.census_tensors, calls_per_step=calls)
        self._skipped_steps = self.engine.skipped_steps

    def check_step_applied(self) -> None:
        """DeepSpeed skips an optimizer step whose gradient norm is not finite in BF16_Optimizer
        and ZeRO-3 whatever bf16.check_grad_overflow says (ZeRO-1/2 obey it: false). The
        reference never skips one, so a skipped step stops the run instead of passing silently."""
        if self.engine.skipped_steps != self._skipped_steps:
            raise NonFiniteStep(
                f"DeepSpeed skipped the optimizer step ({type(self.optimizer).__name__}: the gradient "
                "norm was not finite); the reference applies every step, so the runs would no longer "
                "be comparable"
            )

    # ------------------------------------------------------------------ memory census

    def census_tensors(self) -> dict[str, list]:
        """The tensors DeepSpeed holds on this rank, by census category (harness.measure.
        tensor_census keeps each storage once, in the first category naming it: a parameter
        partition that is its own master - fp32 ZeRO-3, the pipeline without ZeRO - counts as a
        parameter). Module parameters (ZeRO-3: their ds_tensor partitions; a released full
        parameter holds no storage) and the wrapper's flat bf16 buffers; buffers: the wrapper's
        reduce buckets (communication scratch of reduce_bucket_size elements, whatever the model's
        size: ZeRO-3 keeps its bucket for the run), listed before the gradients so that a gradient
        still viewing a bucket leaves it a buffer; gradients: every .grad and grad_accum of the
        module's parameters, the wrapper's accumulation and partition buffers, the masters' .grad;
        the masters; the basic optimizer's state."""
        opt, basic = self.optimizer, self.engine.basic_optimizer
        params = list(self.engine.module.parameters())
        masters = list(_tensors(*(getattr(opt, a, None) for a in _WRAPPER_MASTERS)))
        masters += [p for group in basic.param_groups for p in group["params"]]
        parameters = [getattr(p, "ds_tensor", None) for p in params] + params
        parameters += list(_tensors(*(getattr(opt, a, None) for a in _WRAPPER_PARAMETERS)))
        gradients = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
        gradients += list(_tensors(*(getattr(opt, a, None) for a in _WRAPPER_GRADIENTS)))
        buffers = [
            t for b in (getattr(opt, "ipg_buckets", None) or {}).values() for t in _tensors(getattr(b, "buffer", None))
        ]
        gradients += [m.grad for m in masters]
        return {
            "parameters": parameters,
            "buffers": buffers,
            "gradients": gradients,
            "master_parameters": masters,
            "optimizer_states": optimizer_state_tensors(basic),
        }

    def memory_census(self) -> dict | None:
        return self.census.result if self.census is not None else None

    def activation_exclusions(self) -> list:
        """The parameters (ZeRO-3: their partitions and the persistent whole ones). ZeRO-3's
        gathered full parameters exist only inside the forward, after SavedActivations has taken
        its exclusions: what autograd saves of them counts as activations."""
        params = list(self.engine.module.parameters())
        return params + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]

    def local_micro_batches(self, global_batch: torch.Tensor, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of this data-parallel rank's micro-batches: its contiguous slice of
        the global batch (by dp rank: the ranks of one tensor- or pipeline-parallel group share it)."""
        local = dp_slice(global_batch, dp_rank, self.dp).to(self.device, non_blocking=True)
        micro = micro_batches(local, self.spec.layout.micro_batch_size)
        expected = self.config["gradient_accumulation_steps"]
        assert len(micro) == expected, (len(micro), expected)
        return micro

    def grad_norm(self) -> float | None:
        """DeepSpeed's own global norm of the last step (engine.get_global_grad_norm: ZeRO's and the
        bf16 optimizer's norm over every partition, unscaled); None where its optimizer keeps none
        (ZeRO-0 in fp32 clips with a norm it does not keep)."""
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def last_step_details(self) -> dict:
        # DeepSpeed exposes no per-step breakdown, communication counts or pipeline timeline
        # without its wall_clock_breakdown timers (which synchronise the device and change what
        # is measured): nothing is reported, nothing is estimated.
        return {}

    def process_groups(self) -> dict:
        """The groups ZeRO reduces over, for the profiler's axis names: at dp 1 a one-rank group,
        which its ranks alone cannot tell from the other axes of degree 1."""
        opt = self.optimizer
        dp = [getattr(self.engine, "data_parallel_group", None), getattr(self.engine, "seq_data_parallel_group", None)]
        dp += [getattr(opt, "dp_process_group", None), *(getattr(opt, "real_dp_process_group", None) or [])]
        return {"dp": dp}

    def describe_common(self) -> dict:
        lay = self.spec.layout
        opt = getattr(self.engine, "basic_optimizer", None) or self.optimizer
        d = {
            "framework": "deepspeed",
            "deepspeed_version": __import__("deepspeed").__version__,
            "zero_stage": self.stage,
            "tp": lay.tp,
            "cp": lay.cp,
            "pp": lay.pp,
            "dp": self.dp,
            "ds_config_file": self.config_file,
            "ds_config": self.config,
            "ds_config_auto_filled": self.filled,
            "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
            "optimizer_wrapper": type(self.optimizer).__name__,
            "model_impl": lay.model_impl,
            "flops_counted_by": "harness (analytic); DeepSpeed's flops profiler double-counts under ZeRO-3",
        }
        d["precision_policy"] = self.policy.describe()
        if self.policy.fp8:
            d["fp8_backend"] = self.policy.fp8_backend(self.ctx.device.type)
        d["precision_config"] = self.precision_config()
        return d

    def precision_config(self) -> str:
        """How DeepSpeed was configured to the policy: its keys as set, and the wrapper they chose."""
        c = self.config
        bf16 = c.get("bf16") or {}
        keys = [
            f"bf16.enabled {str(bool(bf16.get('enabled'))).lower()}",
            f"data_types.grad_accum_dtype {c['data_types']['grad_accum_dtype']}",
            f"communication_data_type {c['communication_data_type']}",
        ]
        if bf16.get("enabled"):
            keys.append(f"bf16.check_grad_overflow {str(bf16.get('check_grad_overflow')).lower()}")
        return f"{', '.join(keys)} -> {type(self.optimizer).__name__}"
