"""A ds_config (DeepSpeed's JSON config keys) read back as a harness workload and layout
(harness/interop/imports.py checks them as a spec); the model and sequence length, which a ds_config
does not hold, from the arguments. A key the harness cannot carry is listed with why, never guessed.
Bad input raises SpecError naming the key.
"""

from __future__ import annotations

import json

from harness.errors import SpecError

# ds_config keys carried (or listed by name below)
DEEPSPEED_KEYS = {
    *"train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping bf16".split(),
    *"optimizer zero_optimization data_types communication_data_type tensor_parallel pipeline".split(),
    *"sequence_parallel_size activation_checkpointing scheduler".split(),
}


def read_deepspeed(text: str, model: str | None, seq_len: int | None) -> tuple[dict, dict, list[str]]:
    """(workload, layout, not carried) of a ds_config; the model and sequence length, which a ds_config
    does not hold, from the arguments."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError("ds_config", f"not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError("ds_config", "top level must be an object")
    lost = []

    def need(key, kind=int):
        v = cfg.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise SpecError(key, f"needs a whole number, got {v!r}")
        return v

    micro, accum = need("train_micro_batch_size_per_gpu"), need("gradient_accumulation_steps")
    batch = need("train_batch_size")
    tp = ((cfg.get("tensor_parallel") or {}).get("autotp_size")) or 1
    pp = ((cfg.get("pipeline") or {}).get("stages")) or 1
    cp = cfg.get("sequence_parallel_size") or 1
    if batch % (micro * accum):
        raise SpecError("train_batch_size", f"{batch} is not micro-batch {micro} x accumulation {accum} x dp")
    zero = cfg.get("zero_optimization") or {}
    ckpt = cfg.get("activation_checkpointing")
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": batch // (micro * accum),
        "cp": cp,
        "micro_batch_size": micro,
        "zero_stage": zero.get("stage", 0),
        "activation_checkpointing": "full"
        if ckpt is not None or (cfg.get("pipeline") or {}).get("activation_checkpoint_interval")
        else "none",
        **({"cp_impl": "ulysses"} if cp > 1 else {}),
    }
    if ckpt is not None:
        lost.append(
            "activation_checkpointing: not carried: which blocks are wrapped is in the model code; written as full"
        )
    opt = cfg.get("optimizer") or {}
    if opt and opt.get("type", "").lower() not in ("adamw", "adam"):
        lost.append(f"optimizer.type: not carried: {opt.get('type')}; the harness trains with AdamW")
    params = opt.get("params") or {}
    workload = {
        "model": model or "tiny",
        "seq_len": seq_len or 128,
        "global_batch_size": batch,
        "precision": "bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp32",
        "optimizer": {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params},
    }
    for key, field in (("grad_accum_dtype", "grad_accum_dtype"), ("communication_data_type", "grad_reduce_dtype")):
        value = (cfg.get("data_types") or {}).get(key) if key == "grad_accum_dtype" else cfg.get(key)
        if value in ("fp32", "bf16"):
            workload[field] = value
        elif value is not None:
            lost.append(f"{key}: not carried: {value}; the harness accumulates and reduces in fp32 or bf16")
    lost.append("attention: not carried: a ds_config has none (the model code chooses); written as sdpa")
    lost += [f"{k}: not carried: the harness has no such setting" for k in cfg if k not in DEEPSPEED_KEYS]
    lost += [
        f"zero_optimization.{k}: not carried: engine deepspeed runs the harness's ds_configs/"
        for k in zero
        if k != "stage"
    ]
    if "gradient_clipping" in cfg:
        workload["grad_clip"] = cfg["gradient_clipping"]
    if model is None:
        lost.append("model: not carried: a ds_config has none; written as tiny (give --model)")
    if seq_len is None:
        lost.append("seq_len: not carried: a ds_config has none; written as 128 (give --seq-len)")
    if cfg.get("scheduler"):
        lost.append("scheduler: not carried: the harness trains at a constant learning rate")
    return workload, layout, lost
