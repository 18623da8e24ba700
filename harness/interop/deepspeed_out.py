"""The chosen layout as a ds_config for DeepSpeed DEEPSPEED (batch, bf16, AdamW, clipping, ZeRO with
the buckets and prefetch the harness's ds_configs/zeroN.json measure), and why DeepSpeed cannot run
a layout: what the harness's engine deepspeed runs (its facts). Nothing here imports torch."""

from __future__ import annotations

import json

from harness.interop.optimizer import optimizer_and_clip
from harness.model.presets import Shape
from harness.planner.layout import PlannerLayout, Workload
from harness.spec import Layout, Optimizer, capability_error

DEEPSPEED = "0.19.8"
VERSION = f"DeepSpeed {DEEPSPEED}"
CP_COMM = {"ulysses": "ulysses"}  # the cp implementations it runs: Ulysses only
# DeepSpeed's ZeRO settings as the harness's ds_configs/zeroN.json run them (bucket sizes in elements).
ZERO_BUCKET = 50_000_000
ZERO3_MAX_LIVE = 1_000_000_000


def autoep_preset(shape: Shape) -> str:
    """AutoEP's preset for the model's MoE blocks (its registry: mixtral, qwen3_moe, ...): Qwen3-MoE has
    per-head q/k norms, Mixtral none."""
    return "qwen3_moe" if shape.qk_norm else "mixtral"


def deepspeed_refuses(lay: PlannerLayout) -> str:
    """Why engine deepspeed's facts refuse the layout ("" if they do not), its ZeRO stage the
    layout's sharding (full sharding is stage 3): AutoTP or its pipeline engine, Ulysses without
    either, no sequence parallelism, 1F1B only."""
    layout = {**lay.to_spec(), "engine": "deepspeed", "zero_stage": lay.sharding_stage}
    if lay.pp == 1 and lay.sharding_stage == 0:
        layout["zero_stage"] = 1  # DeepSpeed runs stage 0 (plain data parallelism); the harness measures ZeRO
    error = capability_error(Layout(**layout))
    return "" if error is None else error.reason


def export_deepspeed(
    shape: Shape, lay: PlannerLayout, wl: Workload, optimizer: Optimizer | None = None, grad_clip: float | None = None
) -> tuple[str, list[str]]:
    """A ds_config (DeepSpeed's JSON config keys) for the layout."""
    opt, clip = optimizer_and_clip(optimizer, grad_clip)
    bf16 = wl.dtype_bytes == 2
    stage = lay.sharding_stage
    zero = {"stage": stage, "reduce_bucket_size": ZERO_BUCKET, "allgather_bucket_size": ZERO_BUCKET}
    zero.update(overlap_comm=stage > 0, contiguous_gradients=stage > 0)
    if stage == 3:  # HF's "auto" persistence threshold: 10 x hidden elements stay gathered
        zero.update(
            stage3_prefetch_bucket_size=ZERO_BUCKET,
            stage3_param_persistence_threshold=10 * shape.hidden,
            stage3_max_live_parameters=ZERO3_MAX_LIVE,
        )
    cfg = {
        "train_batch_size": wl.global_batch_size,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": wl.micro_batches(lay),
        "gradient_clipping": clip,
        "bf16": {"enabled": bf16},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay},
        },
        "zero_optimization": zero,
    }
    if bf16:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["communication_data_type"] = "fp32"
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
    autotp_world = lay.tp > 1 and lay.pp == 1
    if autotp_world:  # DeepSpeed's batch check counts every rank here: let it derive train_batch_size
        del cfg["train_batch_size"]
    if shape.moe and lay.ep > 1:  # AutoEP (deepspeed/module_inject/auto_ep_config.py)
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": lay.ep, "preset_model": autoep_preset(shape)}
    if lay.cp > 1:  # Ulysses' degree: ZeRO then shards over the dp x cp ranks
        cfg["sequence_parallel_size"] = lay.cp
    if lay.pp > 1:
        cfg["pipeline"] = {
            "stages": lay.pp,
            "partition": "uniform",
            "activation_checkpoint_interval": 1 if lay.activation_checkpointing == "full" else 0,
        }
    if lay.activation_checkpointing != "none":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    # the plan's kernels, which a ds_config has no setting for (the model code's): DeepSpeedConfig ignores an
    # unknown top-level key (its sections forbid one); `harness import` reads them back
    cfg["harness"] = {"attention": lay.attention, "rmsnorm": lay.rmsnorm}
    ulysses = " x sequence_parallel_size" if lay.cp > 1 else ""
    notes = [
        f"for {VERSION}; no scheduler section: a constant learning rate, as the harness trains",
        f"data parallel degree {lay.dp} = world size / (tp x pp{ulysses}): launch {lay.gpus} ranks",
        "Ulysses: wrap the attention core in deepspeed.sequence.layer.DistributedAttention over a sequence "
        f"group of {lay.cp} ranks and feed each its chunks i and 2cp-1-i"
        if lay.cp > 1
        else "",
        "pipeline stages are the PipelineModule's num_stages in your code; the config repeats them"
        if lay.pp > 1
        else "",
    ]
    if lay.activation_checkpointing == "selective":
        notes.append(
            "DeepSpeed has no selective recomputation: wrap the attention core in "
            "deepspeed.checkpointing.checkpoint yourself"
        )
    elif lay.activation_checkpointing == "full" and lay.pp == 1:
        notes.append("full checkpointing: wrap each block in deepspeed.checkpointing.checkpoint")
    notes.append(
        f"attention {lay.attention}, rmsnorm {lay.rmsnorm}: kernels are chosen in the model code (the "
        '"harness" key records them; DeepSpeed ignores it)'
    )
    if lay.compile == "blocks":
        notes.append("compile blocks: compile each block before deepspeed.initialize (a ds_config has no such setting)")
    if autotp_world:
        notes.append(
            "no train_batch_size: DeepSpeed's AutoTP path (no mpu) checks the batch against all "
            f"{lay.dims.excluding('cp')} ranks, the tp ranks sharing each micro-batch; it derives micro x "
            "accumulation x ranks itself, "
            f"{wl.global_batch_size} sequences a step over dp {lay.dp}"
        )
    if shape.moe and lay.ep > 1:
        notes.append(
            f"MoE: AutoEP replaces the Hugging Face model's MoE blocks (preset_model {autoep_preset(shape)}) with "
            f"experts over {lay.ep} ranks; another model names its modules (moe_layer_pattern, expert_pattern)"
        )
    return json.dumps(cfg, indent=2), [n for n in notes if n]
