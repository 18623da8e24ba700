"""`harness plan --export`: the chosen layout as a launch configuration of a named version of a tool.

- export_deepspeed(): a complete ds_config for DeepSpeed 0.19.8 (batch, bf16, AdamW, clipping, ZeRO
  with the buckets and prefetch the harness's ds_configs/zeroN.json measure).
- export_megatron(): Megatron-LM's pretrain_gpt.py arguments as megatron/training/arguments.py reads
  them at commit MEGATRON_LM (layout, model shape, AdamW, constant LR, overlap, attention backend).
- export_torchtitan(): a torchtitan recipe (a Python function returning Trainer.Config, the config
  system that replaced the TOML files) for torchtitan TORCHTITAN (harness/planner/export_torchtitan.py).

exportable() says why a target cannot run a layout; a layout it refuses is never exported. Each
exporter returns (text, notes): the notes say what the target does differently from the prediction.
The optimizer is harness.spec's (the workload's AdamW and gradient clipping; constant LR, as the
harness trains). Nothing here imports torch.
"""

from __future__ import annotations

import json

from harness.model.presets import Shape
from harness.planner.export_torchtitan import TORCHTITAN, export_torchtitan, torchtitan_refuses
from harness.planner.layout import PlannerLayout, Workload
from harness.spec import Optimizer

EXPORT_FORMATS = ("deepspeed", "megatron", "torchtitan")
DEEPSPEED = "0.19.8"
MEGATRON_LM = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # NVIDIA/Megatron-LM main, 2026-08-22
VERSIONS = {
    "deepspeed": f"DeepSpeed {DEEPSPEED}",
    "megatron": f"Megatron-LM {MEGATRON_LM[:12]} (megatron/training/arguments.py)",
    "torchtitan": f"torchtitan {TORCHTITAN} (Trainer.Config recipe)",
}
# Each target's name for the cp implementations it runs: Megatron-LM's --cp-comm-type (p2p: the
# ring of K/V blocks; a2a: Ulysses' all-to-all), torchtitan's (its own choice: no option names it
# in TORCHTITAN), DeepSpeed's Ulysses only.
CP_COMM = {
    "megatron": {"ring": "p2p", "allgather": "all_gather", "ulysses": "a2a"},
    "torchtitan": {"ring": "ring", "allgather": "allgather"},
    "deepspeed": {"ulysses": "ulysses"},
}
# Megatron-LM's --attention-backend (megatron.core.transformer.enums.AttnBackend) for each kernel:
# flash and fused (cuDNN) run in Transformer Engine; local is Megatron's own core attention
# (DotProductAttention, the score matrix materialised as naive and fused_softmax do; the harness's
# engine megatron runs it). xformers-style memory-efficient attention has none.
MEGATRON_ATTENTION = {
    "naive": "local",
    "fused_softmax": "local",
    "flash1": "flash",
    "flash2": "flash",
    "sdpa": "flash",
    "sdpa_flash": "flash",
    "sdpa_cudnn": "fused",
    "te_fused": "fused",  # Transformer Engine's cuDNN fused attention: AttnBackend.fused
    "flash3": "flash",  # Transformer Engine's flash backend runs FlashAttention-3 on Hopper where installed
}
# DeepSpeed's ZeRO settings as the harness's ds_configs/zeroN.json run them (bucket sizes in elements).
ZERO_BUCKET = 50_000_000
ZERO3_MAX_LIVE = 1_000_000_000


def _deepspeed_refuses(lay: PlannerLayout) -> str:
    """Why engine deepspeed's facts refuse the layout ("" if they do not), its ZeRO stage the
    layout's sharding (full sharding is stage 3)."""
    from harness.spec import Layout, capability_error

    layout = {**lay.to_spec(), "engine": "deepspeed", "zero_stage": lay.sharding_stage}
    if lay.pp == 1 and lay.sharding_stage == 0:
        layout["zero_stage"] = 1  # DeepSpeed runs stage 0 (plain data parallelism); the harness measures ZeRO
    error = capability_error(Layout(**layout))
    return "" if error is None else error.reason


def exportable(lay: PlannerLayout, fmt: str, shape: Shape | None = None) -> str:
    """Empty when `fmt` runs the layout (and, given, the model's shape), else why not."""
    if lay.cp > 1 and lay.cp_impl not in CP_COMM[fmt]:
        return f"{fmt} has no {lay.cp_impl} context parallelism (it runs {', '.join(CP_COMM[fmt])})"
    if lay.shard_group < lay.replicas and (fmt != "torchtitan" or lay.shard_group % lay.cp):
        # torchtitan's FSDP mesh is data_parallel_shard_degree x cp: a group of whole cp groups
        return f"{fmt} has no sharding group of {lay.shard_group} of the dp x cp = {lay.replicas} ranks (HSDP)"
    if lay.precision == "fp8" and fmt != "megatron":  # Megatron-LM's FP8 is its --fp8-* arguments
        return (
            f"{fmt}: FP8 is not a setting this export writes (DeepSpeed's config has none: torchao converts "
            "the model before deepspeed.initialize; torchtitan's Float8 converter is written for main, not 0.3.0)"
        )
    if fmt == "deepspeed":  # what the harness's engine deepspeed runs (its facts): AutoTP or its pipeline
        return _deepspeed_refuses(lay)  # engine, Ulysses without either, no sequence parallelism, 1F1B only
    if fmt == "megatron":
        if shape is not None and shape.moe and lay.tp > 1 and not lay.sequence_parallel:
            return "Megatron-LM runs MoE with tensor parallelism only under sequence parallelism"
        if lay.sharding_stage > 1:
            return "Megatron-LM shards over dp with its distributed optimizer (ZeRO-1); ZeRO-2/3 is Megatron-FSDP"
        if lay.pp > 1 and lay.pipeline_schedule not in ("1f1b", "interleaved"):
            return f"Megatron-LM runs 1F1B or interleaved 1F1B, not {lay.pipeline_schedule}"
        backend = MEGATRON_ATTENTION.get(lay.attention)
        if backend is None:
            return f"Megatron-LM has no attention backend like {lay.attention}"
        if lay.cp > 1 and backend == "local":
            return (
                f"Megatron-LM's context parallelism runs in Transformer Engine's attention; {lay.attention} "
                "is its local (non-TE) attention"
            )
    if fmt == "torchtitan":
        return torchtitan_refuses(shape, lay)
    return ""


def _optimizer(optimizer: Optimizer | None, grad_clip: float | None) -> tuple[Optimizer, float]:
    """The workload's optimizer and clipping, harness.spec's defaults where not given."""
    from harness.spec import Workload as SpecWorkload

    return optimizer or Optimizer(), SpecWorkload().grad_clip if grad_clip is None else grad_clip


def export_deepspeed(
    shape: Shape, lay: PlannerLayout, wl: Workload, optimizer: Optimizer | None = None, grad_clip: float | None = None
) -> tuple[str, list[str]]:
    """A ds_config (DeepSpeed's JSON config keys) for the layout."""
    opt, clip = _optimizer(optimizer, grad_clip)
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
    ulysses = " x sequence_parallel_size" if lay.cp > 1 else ""
    notes = [
        f"for {VERSIONS['deepspeed']}; no scheduler section: a constant learning rate, as the harness trains",
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
    notes.append(f"attention {lay.attention}, rmsnorm {lay.rmsnorm}: kernels are chosen in the model code")
    if lay.compile == "blocks":
        notes.append("compile blocks: compile each block before deepspeed.initialize (a ds_config has no such setting)")
    if shape.moe:  # DeepSpeed-MoE's experts and their parallelism are the model code's
        notes.append(
            f"MoE: a ds_config has no expert setting: build each layer's experts as deepspeed.moe.layer.MoE("
            f"num_experts={shape.experts}, ep_size={lay.ep}, k={shape.experts_per_token}) in the model code"
        )
    return json.dumps(cfg, indent=2), [n for n in notes if n]


def _megatron_shape(shape: Shape, wl: Workload) -> list:
    """The model's shape as Megatron-LM arguments (LLaMA: no dropout, no MLP biases, RMSNorm, RoPE)."""
    args = [
        "--seq-length",
        wl.seq_len,
        "--max-position-embeddings",
        max(wl.seq_len, shape.max_positions),
        "--num-layers",
        shape.layers,
        "--hidden-size",
        shape.hidden,
        "--ffn-hidden-size",
        shape.ffn,
        "--num-attention-heads",
        shape.heads,
    ]
    if shape.kv_channels:
        args += ["--kv-channels", shape.kv_channels]
    if shape.kv_heads != shape.heads:
        args += ["--group-query-attention", "--num-query-groups", shape.kv_heads]
    args += ["--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", f"{shape.norm_eps:g}"]
    args += ["--position-embedding-type", "rope", "--rotary-base", int(shape.rope_theta)]
    args += ["--attention-dropout", 0, "--hidden-dropout", 0, "--disable-bias-linear"]
    if shape.rope_scaling:
        args += ["--use-rope-scaling", "--rope-scaling-factor", f"{shape.rope_scaling[0]:g}"]
    if shape.has_qkv_bias:
        args.append("--add-qkv-bias")
    if shape.qk_norm:
        args.append("--qk-layernorm")
    if not shape.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    return args


def _megatron_moe(shape: Shape, lay: PlannerLayout, notes: list) -> list:
    """A MoE model's experts and their parallelism as Megatron-LM arguments, as the planner predicts them
    (harness/planner/moe.py): every layer MoE, the alltoall dispatcher, grouped GEMM, experts tp-sharded."""
    args = ["--num-experts", shape.experts, "--moe-router-topk", shape.experts_per_token]
    args += ["--moe-ffn-hidden-size", shape.moe_ffn, "--expert-model-parallel-size", lay.ep]
    args += ["--expert-tensor-parallel-size", lay.tp, "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
    if not shape.norm_topk:  # Megatron's default is the softmax over the top-k logits: renormalised
        args.append("--moe-router-pre-softmax")
    args += ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", 0]
    notes.append(
        "MoE: the auxiliary load-balancing loss coefficient is the workload's (0 here): set yours; the plan "
        "assumed the busiest expert-parallel rank at 1.1x the mean tokens, which a balanced router gives"
    )
    return args


def export_megatron(
    shape: Shape, lay: PlannerLayout, wl: Workload, optimizer: Optimizer | None = None, grad_clip: float | None = None
) -> tuple[str, list[str]]:
    """Megatron-LM's pretrain_gpt.py arguments for the layout, the model's shape and the optimizer."""
    opt, clip = _optimizer(optimizer, grad_clip)
    backend = MEGATRON_ATTENTION[lay.attention]
    args = ["--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp]
    if lay.cp > 1:
        args += ["--context-parallel-size", lay.cp, "--cp-comm-type", CP_COMM["megatron"][lay.cp_impl]]
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    notes = [f"for {VERSIONS['megatron']}"]
    if shape.moe:
        args += _megatron_moe(shape, lay, notes)
    if lay.pp > 1 and lay.pipeline_schedule == "interleaved" and lay.virtual_stages > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", lay.virtual_stages]
        if shape.layers % (lay.pp * lay.virtual_stages):
            notes.append(f"{shape.layers} layers do not split evenly into {lay.pp} x {lay.virtual_stages} chunks")
    args += ["--micro-batch-size", lay.micro_batch_size, "--global-batch-size", wl.global_batch_size]
    args += _megatron_shape(shape, wl)
    # AdamW (Megatron-LM's adam is decoupled weight decay), the harness's constant learning rate
    args += ["--optimizer", "adam", "--lr", f"{opt.lr:g}", "--min-lr", f"{opt.lr:g}", "--lr-decay-style", "constant"]
    args += ["--lr-warmup-iters", 0, "--weight-decay", f"{opt.weight_decay:g}"]
    args += ["--adam-beta1", f"{opt.betas[0]:g}", "--adam-beta2", f"{opt.betas[1]:g}", "--adam-eps", f"{opt.eps:g}"]
    args += ["--clip-grad", f"{clip:g}"]
    if wl.dtype_bytes == 2:  # the planner's policy: main gradients accumulated and reduced in fp32
        args += ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
    if lay.precision == "fp8":  # Transformer Engine's current scaling (FP8-CS): e4m3 forward, e5m2 gradients
        args += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    if lay.replicas > 1:
        args.append("--overlap-grad-reduce")
        if lay.sharding_stage >= 1:
            args += ["--use-distributed-optimizer", "--overlap-param-gather"]
    if lay.activation_checkpointing == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    elif lay.activation_checkpointing == "selective":
        args += ["--recompute-granularity", "selective"]
    if backend == "local":
        args += ["--transformer-impl", "local", "--spec", "local"]
    else:
        args += ["--transformer-impl", "transformer_engine"]
    args += ["--attention-backend", backend]
    notes.append(f"vocabulary {shape.vocab}: set by your tokenizer (--tokenizer-type/--vocab-size)")
    notes.append(
        f"data parallel {lay.dp}: Megatron-LM takes it from the world size, {lay.gpus} ranks / (tp x pp"
        + (" x cp)" if lay.cp > 1 else ")")
    )
    notes.append(
        "context parallelism runs in Transformer Engine's attention (--transformer-impl transformer_engine)"
        if lay.cp > 1
        else "Megatron-LM's context parallelism (--context-parallel-size) needs Transformer Engine's attention"
    )
    notes.append(f"attention {lay.attention}: --attention-backend {backend}")
    if shape.attention_bias:
        notes.append(
            "the output projection's bias (transformers' o_proj) has no Megatron-LM flag: "
            "--add-qkv-bias covers q/k/v only"
        )
    if lay.rmsnorm == "torch":
        notes.append("Megatron-LM's RMSNorm is fused (Transformer Engine/Apex): faster than the eager one predicted")
    if lay.compile == "blocks":
        notes.append("compile blocks: Megatron-LM compiles no block; Transformer Engine's fused kernels stand in")
    return " ".join(str(a) for a in args), notes


EXPORTERS = {"deepspeed": export_deepspeed, "megatron": export_megatron, "torchtitan": export_torchtitan}
