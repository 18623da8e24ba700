"""engine: deepspeed - the same LLaMA under deepspeed.initialize with ZeRO stage 1, 2 or 3.

What is the same as the reference (harness/frameworks/single.py):
  - initial weights: harness.model.llama.ReferenceWeights(shape, seed), loaded before DeepSpeed partitions them;
  - tokens: every rank builds the step's global batch and takes its contiguous dp slice;
  - the loss: lm_loss on logits, averaged over micro-batches (DeepSpeed divides each
    micro-batch's loss by gradient_accumulation_steps) and over ranks (gradient averaging);
  - AdamW with the workload's hyperparameters, global-norm clipping, constant learning rate.
    On CPU the optimizer is torch.optim.AdamW (`torch_adam`), the reference's own; on GPU it is
    DeepSpeed's FusedAdam, DeepSpeed's best (CPUAdam with optimizer offload).
What differs, and is said in describe():
  - bf16: DeepSpeed keeps bf16 parameters and gradients with fp32 master weights in the
    optimizer; the reference runs fp32 weights under torch.autocast. Losses differ ~1e-4.
  - activation checkpointing `full` uses deepspeed.checkpointing.checkpoint per block;
    `selective` is the model's own attention-core recomputation (DeepSpeed has no such mode).
"""

from __future__ import annotations

import os
import types

import torch
import torch.distributed as dist

from harness.data.source import dp_slice
from harness.frameworks.ds_config import build_config


def _quiet_deepspeed() -> None:
    import logging

    try:
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
    except Exception:  # noqa: BLE001 - logging only
        pass


def _init_deepspeed_comm(ctx) -> None:
    """Make DeepSpeed use the process group harness.dist.init already created."""
    import deepspeed

    if ctx.backend is None:
        raise RuntimeError("engine deepspeed needs a process group (run it under a launcher)")
    deepspeed.init_distributed(dist_backend=ctx.backend, dist_init_required=False)


def _ds_checkpointed_layers(model, checkpoint_fn):
    """Replace Llama.run_layers so each block runs under DeepSpeed's checkpoint (names kept)."""

    def run_layers(self, h, cos, sin):
        for layer in self.layers:
            if torch.is_grad_enabled():
                h = checkpoint_fn(layer, h, cos, sin)
            else:
                h = layer(h, cos, sin)
        return h

    model.checkpointing = "none"
    model.run_layers = types.MethodType(run_layers, model)


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, spec, shape, ctx):
        w, lay = spec.workload, spec.layout
        self.spec, self.ctx, self.device = spec, ctx, ctx.device
        # the config is checked first: a contradiction is a SpecError before DeepSpeed loads
        self.config, self.config_file, self.filled = build_config(spec, shape, world_size=ctx.world_size,
                                                                  device_type=ctx.device.type)
        import deepspeed

        _quiet_deepspeed()
        self.stage = self.config["zero_optimization"]["stage"]
        _init_deepspeed_comm(ctx)

        ckpt = lay.activation_checkpointing
        if lay.model_impl == "hf":
            if ckpt == "selective":
                from harness.errors import SpecError

                raise SpecError("layout.activation_checkpointing",
                                "selective is not offered by transformers' LlamaForCausalLM; use none or full")
            from harness.frameworks.hf_llama import build_hf_llama

            model = build_hf_llama(shape, w.seed, lay.attention, device=ctx.device)
        elif self.stage == 3:
            model = self._build_partitioned(shape, lay, "selective" if ckpt == "selective" else "none")
        else:
            from harness.model.llama import build_model

            model = build_model(shape, w.seed, lay.attention, lay.rmsnorm,
                                "selective" if ckpt == "selective" else "none", device=ctx.device)
        if ckpt == "full":
            deepspeed.checkpointing.configure(None, deepspeed_config=self.config)
            if lay.model_impl == "hf":
                model.hf.gradient_checkpointing_enable()
                for module in model.hf.modules():
                    if hasattr(module, "_gradient_checkpointing_func"):
                        module._gradient_checkpointing_func = deepspeed.checkpointing.checkpoint
            else:
                _ds_checkpointed_layers(model, deepspeed.checkpointing.checkpoint)
        self.param_names = {p: n for n, p in model.named_parameters()}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=self.config)
        self.micro = self.engine.gradient_accumulation_steps()
        self._details: dict = {}

    def _build_partitioned(self, shape, lay, checkpointing: str):
        """ZeRO-3: construct under deepspeed.zero.Init (each parameter partitioned as soon as its
        module exists), then load the reference weights one gathered parameter at a time from
        rank 0 - no rank ever holds the whole model on the device."""
        import deepspeed

        from harness.model.llama import Llama, ReferenceWeights

        with deepspeed.zero.Init(config_dict_or_path=self.config):
            model = Llama(shape, lay.attention, lay.rmsnorm, checkpointing)
        reference = ReferenceWeights(shape, self.spec.workload.seed) if self.ctx.rank == 0 else None
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.ctx.rank == 0:
                    with torch.no_grad():
                        param.data.copy_(reference[name].to(param.device))
        return model

    # ------------------------------------------------------------------ training

    def train_step(self, global_batch: torch.Tensor) -> float:
        from harness.model.llama import lm_loss

        lay = self.spec.layout
        local = dp_slice(global_batch, self.ctx.rank, self.ctx.world_size).to(self.device, non_blocking=True)
        chunks = local.split(lay.micro_batch_size)
        assert len(chunks) == self.micro, (len(chunks), self.micro)
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for chunk in chunks:
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            logits = self.engine(inputs)
            loss = lm_loss(logits, targets)
            self.engine.backward(loss)  # scales by 1 / gradient_accumulation_steps
            self.engine.step()  # the optimizer steps at the accumulation boundary only
            total += loss.detach().float()
        total /= len(chunks)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return (total / self.ctx.world_size).item()

    # ------------------------------------------------------------------ inspection

    def full_state_dict(self):
        """fp32 master weights (all ranks take part in the gather; rank 0 keeps them)."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for param, name in self.param_names.items():
            full = safe_get_full_fp32_param(param)
            if full is None:  # not managed by a ZeRO optimizer: the parameter itself is whole
                full = param.detach()
            if self.ctx.rank == 0:
                out[self._plain_name(name)] = full.detach().float().cpu().clone().reshape(full.shape)
        return out if self.ctx.rank == 0 else None

    def _plain_name(self, name: str) -> str:
        if self.spec.layout.model_impl == "hf":
            from harness.frameworks.hf_llama import from_hf_name

            return from_hf_name(name[len("hf."):])
        return name

    def last_step_details(self) -> dict:
        return dict(self._details)

    def describe(self) -> dict:
        opt = self.engine.basic_optimizer if hasattr(self.engine, "basic_optimizer") else self.optimizer
        lay, w = self.spec.layout, self.spec.workload
        d = {
            "framework": "deepspeed",
            "deepspeed_version": __import__("deepspeed").__version__,
            "zero_stage": self.stage,
            "ds_config_file": self.config_file,
            "ds_config": self.config,
            "ds_config_auto_filled": self.filled,
            "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
            "optimizer_wrapper": type(self.optimizer).__name__,
            "model_impl": lay.model_impl,
            "activation_checkpointing": {"none": "none", "full": "deepspeed.checkpointing.checkpoint per block",
                                         "selective": "model's attention-core recomputation (torch checkpoint)"}
            [lay.activation_checkpointing],
            "flops_counted_by": "harness (analytic); DeepSpeed's flops profiler double-counts under ZeRO-3",
        }
        if w.precision == "bf16":
            d["precision_note"] = ("DeepSpeed bf16: bf16 parameters, activations and gradients, fp32 master "
                                   "weights and optimizer state; the reference runs fp32 weights under "
                                   "torch.autocast(bf16)")
        else:
            d["precision_note"] = "fp32 throughout, as the reference"
        return d


def build(spec, shape, ctx):
    if spec.layout.tp > 1 or spec.layout.pp > 1:  # until AutoTP and the pipeline engine are wired in
        from harness.errors import SpecError

        raise SpecError("layout.tp" if spec.layout.tp > 1 else "layout.pp", "not built yet for engine deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
    return DeepSpeedEngine(spec, shape, ctx)
