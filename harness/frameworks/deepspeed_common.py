"""What both DeepSpeed engines share (deepspeed_adapter: ZeRO with AutoTP; deepspeed_pipe: the
pipeline engine): the config, DeepSpeed's communication on the harness's process group, this
rank's micro-batches, the weights gathered on rank 0, and the common part of describe().
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.data.source import dp_slice, micro_batches
from harness.frameworks.ds_config import build_config


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

    if ctx.backend is None:
        raise RuntimeError("engine deepspeed needs a process group (run it under a launcher)")
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
    checkpointing.configure(mpu, partition_activations=ac.partition_activations,
                            contiguous_checkpointing=ac.contiguous_memory_optimization,
                            num_checkpoints=ac.number_checkpoints, checkpoint_in_cpu=ac.cpu_checkpointing,
                            synchronize=ac.synchronize_checkpoint_boundary, profile=ac.profile)


def gather_on_rank0(mine: dict | None) -> dict | None:
    """Merge every rank's {name: tensor} (None from ranks that own nothing) on global rank 0.
    Collective: every rank calls it."""
    everyone: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    out: dict = {}
    for part in everyone:
        out.update(part or {})
    return out


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
    """The config and process setup of one DeepSpeed run (dp = world / (tp x pp))."""

    name = "deepspeed"

    def __init__(self, spec, shape, ctx):
        lay = spec.layout
        self.spec, self.shape, self.ctx, self.device = spec, shape, ctx, ctx.device
        self.dp = ctx.world_size // (lay.tp * lay.pp)
        # the config is checked first: a contradiction is a SpecError before DeepSpeed loads
        self.config, self.config_file, self.filled = build_config(spec, shape, dp=self.dp,
                                                                  device_type=ctx.device.type)
        _quiet_deepspeed()
        self.stage = self.config["zero_optimization"]["stage"]
        _init_deepspeed_comm(ctx)
        self.engine = self.optimizer = None  # set by the engine built on this

    def local_micro_batches(self, global_batch: torch.Tensor, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) of this data-parallel rank's micro-batches: its contiguous slice of
        the global batch (by dp rank: the ranks of one tensor- or pipeline-parallel group share it)."""
        local = dp_slice(global_batch, dp_rank, self.dp).to(self.device, non_blocking=True)
        micro = micro_batches(local, self.spec.layout.micro_batch_size)
        expected = self.config["gradient_accumulation_steps"]
        assert len(micro) == expected, (len(micro), expected)
        return micro

    def last_step_details(self) -> dict:
        # DeepSpeed exposes no per-step breakdown, communication counts or pipeline timeline
        # without its wall_clock_breakdown timers (which synchronise the device and change what
        # is measured): nothing is reported, nothing is estimated.
        return {}

    def describe_common(self) -> dict:
        lay, w = self.spec.layout, self.spec.workload
        opt = getattr(self.engine, "basic_optimizer", None) or self.optimizer
        d = {
            "framework": "deepspeed",
            "deepspeed_version": __import__("deepspeed").__version__,
            "zero_stage": self.stage,
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": self.dp,
            "ds_config_file": self.config_file,
            "ds_config": self.config,
            "ds_config_auto_filled": self.filled,
            "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
            "optimizer_wrapper": type(self.optimizer).__name__,
            "model_impl": lay.model_impl,
            "flops_counted_by": "harness (analytic); DeepSpeed's flops profiler double-counts under ZeRO-3",
            "not_measured": "time breakdown, communication counts, pipeline bubble/timeline "
                            "(DeepSpeed exposes them only through its synchronising wall_clock_breakdown timers)",
        }
        if w.precision == "bf16":
            d["precision_note"] = ("DeepSpeed bf16: bf16 parameters, activations and gradients, fp32 master "
                                   "weights and optimizer state; the reference runs fp32 weights under "
                                   "torch.autocast(bf16)")
        else:
            d["precision_note"] = "fp32 throughout, as the reference"
        return d
