"""A ds_config (DeepSpeed's JSON config keys) read back as a harness workload and layout
(harness/interop/imports.py checks them as a spec); the model and sequence length, which a ds_config
does not hold, from the arguments. A key the harness cannot carry is listed with why, never guessed.
Bad input raises SpecError naming the key.

The batch is DeepSpeed's triple (train_batch_size = micro x accumulation x dp), any of it missing or
"auto" (the Hugging Face Trainer's) derived as DeepSpeed's _set_batch_related_parameters does, dp
from --gpus over tp x pp x sequence_parallel_size; with none of it given, the harness's own run's.
"auto" elsewhere (the optimizer, clipping, bf16) is the harness's default, said in one line.
"""

from __future__ import annotations

import json

from harness.errors import SpecError
from harness.interop import exact
from harness.parallel_dims import ParallelDims
from harness.spec import Optimizer
from harness.spec import Workload as SpecWorkload
from harness.spec.schema import ATTENTION_KERNELS, RMSNORM_KERNELS

# ds_config keys carried (or listed by name below)
DEEPSPEED_KEYS = {
    *"train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping bf16".split(),
    *"optimizer zero_optimization data_types communication_data_type tensor_parallel pipeline fp16".split(),
    *"sequence_parallel_size activation_checkpointing scheduler expert_parallel harness".split(),
}
AUTO = ' or "auto"'
BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# DeepSpeed's own defaults for its Adam/AdamW params (FusedAdam: torch's, weight decay 0)
DS_ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
# What DeepSpeed offloads or shards that the harness keeps on the device: refused (a plan of it would be wrong).
OFFLOAD = ("offload_optimizer", "offload_param")


def _whole(value, key: str, auto: bool = True) -> int | None:
    """A whole number >= 1, or None for "auto"/absent."""
    if value is None or (auto and value == "auto"):
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecError(key, f"needs a whole number >= 1{AUTO if auto else ''}, got {value!r}")
    return value


def _section(cfg: dict, key: str) -> dict:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(key, f"must be an object (DeepSpeed's {key} section), got {value!r}")
    return value


def _batch(cfg: dict, model_par: int, share: int, gpus: int | None, lost: list[str]) -> tuple[int, int, int]:
    """(global batch in sequences, micro-batch, dp) by DeepSpeed's rules; dp from --gpus where given.
    `share`: the ranks that share each micro-batch yet count in DeepSpeed's batch check (AutoTP's tp
    without an mpu): train_batch_size counts them, the global batch does not."""
    batch, micro, accum = (_whole(cfg.get(k), k) for k in BATCH)
    dp = None
    if gpus is not None:
        if gpus % model_par:
            raise SpecError("--gpus", f"{gpus} is not divisible by tp x pp x sequence_parallel_size = {model_par}")
        dp = gpus // model_par * share
    if None in (batch, micro, accum) and dp is None and not (batch is None and micro is None and accum is None):
        missing = next(k for k, v in zip(BATCH, (batch, micro, accum), strict=True) if v is None)
        given = repr(cfg[missing]) if missing in cfg else "absent"
        raise SpecError(missing, f"{given}: DeepSpeed derives it from the world size; give --gpus")
    if batch is None and micro is None and accum is None:
        defaults = SpecWorkload()
        micro, dp = 1, dp or share  # without --gpus: one data-parallel group
        batch = max(defaults.global_batch_size // (dp // share), 1) * dp
        lost.append(
            f"train_batch_size: not carried: {cfg.get('train_batch_size', 'absent')!r}; written as the harness's "
            f"own run's {batch // share} sequences, micro-batch {micro}, dp {dp // share}"
        )
        return batch, micro, dp
    if dp is None:
        dp, rem = divmod(batch, micro * accum)
        if rem or dp == 0:
            raise SpecError("train_batch_size", f"{batch} is not micro-batch {micro} x accumulation {accum} x dp")
        return batch, micro, dp
    if batch is not None and micro is not None and accum is None:
        accum = batch // (micro * dp)
    elif batch is not None and accum is not None and micro is None:
        micro = batch // (accum * dp)
    elif batch is None and micro is not None:
        batch = micro * (accum or 1) * dp
    elif micro is None:  # only the global batch: DeepSpeed sets accumulation 1
        accum, micro = 1, batch // dp
    accum = accum or 1
    if micro < 1 or batch != micro * accum * dp:  # DeepSpeed's _batch_assertion
        raise SpecError(
            "train_batch_size", f"{batch} != micro-batch {micro} x accumulation {accum} x dp {dp} (on {gpus} ranks)"
        )
    return batch, micro, dp


def read_deepspeed(
    text: str, model: str | None, seq_len: int | None, gpus: int | None = None
) -> tuple[dict, dict, list[str]]:
    """(workload, layout, not carried) of a ds_config; the model and sequence length, which a ds_config
    does not hold, from the arguments; the world size from --gpus where given."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError("ds_config", f"not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError("ds_config", "top level must be an object")
    lost = []
    tp = _whole(_section(cfg, "tensor_parallel").get("autotp_size"), "tensor_parallel.autotp_size", False) or 1
    pp = _whole(_section(cfg, "pipeline").get("stages"), "pipeline.stages", False) or 1
    cp = _whole(cfg.get("sequence_parallel_size"), "sequence_parallel_size", False) or 1
    share = tp if pp == 1 else 1  # AutoTP's config-only path: DeepSpeed checks the batch over every rank
    batch, micro, ranks = _batch(cfg, ParallelDims(tp=tp, pp=pp, cp=cp).world, share, gpus, lost)
    if ranks % share or batch % share:
        raise SpecError("train_batch_size", f"{batch} over {ranks} ranks does not split into tp {tp} groups")
    batch, dp = batch // share, ranks // share
    zero = _section(cfg, "zero_optimization")
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise SpecError("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage!r}")
    for key in OFFLOAD:
        device = (zero.get(key) or {}).get("device", "none") if isinstance(zero.get(key), dict) else zero.get(key)
        if device not in (None, "none"):
            raise SpecError(
                f"zero_optimization.{key}", f"offload to {device}: the harness keeps every state on the GPU"
            )
    ckpt = _section(cfg, "activation_checkpointing") if "activation_checkpointing" in cfg else None
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "micro_batch_size": micro,
        "zero_stage": stage,
        "activation_checkpointing": "full"
        if ckpt is not None or _section(cfg, "pipeline").get("activation_checkpoint_interval")
        else "none",
        **({"cp_impl": "ulysses"} if cp > 1 else {}),
    }
    ep = _section(cfg, "expert_parallel")
    if ep.get("enabled"):  # AutoEP: engine deepspeed's ds_moe autoep, whose section describes the harness's block
        layout["ep"] = _whole(ep.get("autoep_size"), "expert_parallel.autoep_size", False) or 1
        layout["ds_moe"] = "autoep"
        if ep.get("preset_model"):
            lost.append(
                f"expert_parallel.preset_model: {ep['preset_model']} not carried: the harness writes AutoEP's "
                "section for its own MoE block (harness/frameworks/deepspeed/autoep_config.py)"
            )
    if ckpt is not None:
        lost.append(
            "activation_checkpointing: not carried: which blocks are wrapped is in the model code; written as full"
        )
    workload = {
        "model": model or "tiny",
        "seq_len": seq_len or 128,
        "global_batch_size": batch,
        "precision": _precision(cfg, lost),
        "optimizer": _optimizer(cfg, lost),
    }
    for key, field in (("grad_accum_dtype", "grad_accum_dtype"), ("communication_data_type", "grad_reduce_dtype")):
        value = _section(cfg, "data_types").get(key) if key == "grad_accum_dtype" else cfg.get(key)
        if value in ("fp32", "bf16"):
            workload[field] = value
        elif value not in (None, "auto"):
            lost.append(f"{key}: not carried: {value}; the harness accumulates and reduces in fp32 or bf16")
    given = _section(cfg, "harness")  # `plan --export`'s record of the plan's kernels (DeepSpeed ignores it)
    if "attention" in given:
        layout["attention"] = exact.choose("attention", given["attention"], "sdpa", ATTENTION_KERNELS, "harness", lost)
    else:
        lost.append("attention: not carried: a ds_config has none (the model code chooses); written as sdpa")
    if "rmsnorm" in given:
        layout["rmsnorm"] = exact.choose("rmsnorm", given["rmsnorm"], "torch", RMSNORM_KERNELS, "harness", lost)
    lost += [f"{k}: not carried: the harness has no such setting" for k in cfg if k not in DEEPSPEED_KEYS]
    lost += [
        f"zero_optimization.{k}: not carried: engine deepspeed runs the harness's ds_configs/"
        for k in zero
        if k != "stage"
    ]
    clip = cfg.get("gradient_clipping")
    if clip == "auto":
        lost.append("gradient_clipping: not carried: auto; written as the harness's default")
    elif clip is not None:
        workload["grad_clip"] = clip
    if model is None:
        lost.append("model: not carried: a ds_config has none; written as tiny (give --model)")
    if seq_len is None:
        lost.append("seq_len: not carried: a ds_config has none; written as 128 (give --seq-len)")
    if cfg.get("scheduler"):
        lost.append("scheduler: not carried: the harness trains at a constant learning rate")
    default = SpecWorkload()
    lost.append(
        f"steps, seed: not carried: a ds_config has neither (the training script's); written as the harness's "
        f"({default.steps} steps, seed {default.seed})"
    )
    if ep.get("enabled"):
        lost.append(
            "moe_aux_loss_coeff: not carried: AutoEP's load-balancing coefficient is the model config's; "
            f"written as {default.moe_aux_loss_coeff:g}"
        )
    return workload, layout, lost


def _precision(cfg: dict, lost: list[str]) -> str:
    bf16, fp16 = _section(cfg, "bf16").get("enabled"), _section(cfg, "fp16").get("enabled")
    for key, value in (("bf16.enabled", bf16), ("fp16.enabled", fp16)):
        if value not in (None, True, False, "auto"):
            raise SpecError(key, f'needs true, false or "auto", got {value!r}')
    if fp16 is True:
        lost.append("fp16: not carried: the harness trains in fp32, bf16 or fp8; written as bf16 (2 bytes too)")
        return "bf16"
    if bf16 == "auto":
        lost.append("bf16.enabled: not carried: auto (the Trainer's); written as the harness's default, fp32")
    return "bf16" if bf16 is True else "fp32"


def _optimizer(cfg: dict, lost: list[str]) -> dict:
    """The AdamW hyperparameters (DeepSpeed's defaults where its section omits them; the harness's
    where "auto")."""
    opt = _section(cfg, "optimizer")
    if not opt:
        return {}
    if str(opt.get("type", "")).lower() not in ("adamw", "adam"):
        lost.append(f"optimizer.type: not carried: {opt.get('type')}; the harness trains with AdamW")
        return {}
    params = opt.get("params") or {}
    if not isinstance(params, dict):
        raise SpecError("optimizer.params", f"must be an object, got {params!r}")
    out, harness = {}, Optimizer()
    for k, default in DS_ADAM.items():
        value = params.get(k, default)
        if value == "auto":
            lost.append(f"optimizer.params.{k}: not carried: auto; written as the harness's {getattr(harness, k)}")
            continue
        out[k] = value
    return out
