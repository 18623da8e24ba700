"""The chosen layout as Megatron-LM's pretrain_gpt.py arguments, as megatron/training/arguments.py reads
them at commit MEGATRON_LM (layout, model shape, AdamW, constant LR, overlap, attention backend), and
why Megatron-LM cannot run a layout. Nothing here imports torch."""

from __future__ import annotations

from harness.interop.optimizer import optimizer_and_clip
from harness.model.presets import PRESETS, Shape
from harness.planner.layout import PlannerLayout, Workload
from harness.spec import Optimizer
from harness.spec import Workload as SpecWorkload

MEGATRON_LM = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # NVIDIA/Megatron-LM main, 2026-08-22
VERSION = f"Megatron-LM {MEGATRON_LM[:12]} (megatron/training/arguments.py)"
# Megatron-LM's --cp-comm-type for each cp implementation (p2p: the ring of K/V blocks; a2a: Ulysses'
# all-to-all)
CP_COMM = {"ring": "p2p", "allgather": "all_gather", "ulysses": "a2a"}
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

# The workload's fp8_recipe (torchao's) as Transformer Engine's --fp8-recipe: tensorwise is its current
# per-tensor scaling; for rowwise, its finer-grained blockwise (megatron_in.FP8_RECIPE reads it back as rowwise);
# mxfp8 is Transformer Engine's own MXFP8 recipe (e4m3, e8m0 scales per block of 32)
TE_RECIPE = {"tensorwise": "tensorwise", "rowwise": "blockwise", "rowwise_with_gw_hp": "blockwise", "mxfp8": "mxfp8"}
# Its --fp8-format, the element types torchao casts to under that recipe: tensorwise's output gradient is e5m2
# (hybrid: e4m3 forward, e5m2 backward); rowwise's and mxfp8's are e4m3 throughout (torchao's rowwise recipe and
# mx_mm's grad_elem_dtype), as TE's MXFP8BlockScaling and Float8BlockScaling default to (Format.E4M3)
TE_FORMAT = {"tensorwise": "hybrid", "rowwise": "e4m3", "rowwise_with_gw_hp": "e4m3", "mxfp8": "e4m3"}

# router_aux_loss_coef of the MoE presets' own config.json files
PUBLISHED_AUX_LOSS = {"mixtral-8x7b": 0.02, "qwen3-30b-a3b": 0.001, "qwen3-235b-a22b": 0.001}


def megatron_refuses(shape: Shape | None, lay: PlannerLayout) -> str:
    """Why Megatron-LM at MEGATRON_LM cannot run the layout ("" if it can)."""
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
    return ""


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


def _megatron_moe(shape: Shape, lay: PlannerLayout, notes: list, aux_loss: float | None) -> list:
    """A MoE model's experts and their parallelism as Megatron-LM arguments, as the planner predicts them
    (harness/planner/feedforward.py): every layer MoE, the alltoall dispatcher, grouped GEMM, experts tp-sharded."""
    args = ["--num-experts", shape.experts, "--moe-router-topk", shape.experts_per_token]
    args += ["--moe-ffn-hidden-size", shape.moe_ffn, "--expert-model-parallel-size", lay.ep]
    args += ["--expert-tensor-parallel-size", lay.tp, "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm"]
    if not shape.norm_topk:  # Megatron's default is the softmax over the top-k logits: renormalised
        args.append("--moe-router-pre-softmax")
    coeff = published_aux_loss(shape) if aux_loss is None else aux_loss
    args += ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", f"{coeff:g}"]
    args += ["--moe-router-dtype", "fp32"]  # the router's softmax and top-k in fp32, as the harness's
    if MEGATRON_ATTENTION.get(lay.attention) != "local":
        args.append("--moe-permute-fusion")  # Transformer Engine's fused token permutation
    notes.append(
        f"MoE: auxiliary load-balancing loss coefficient {coeff:g} "
        + ("(the workload's)" if aux_loss is not None else "(the model's published router_aux_loss_coef)")
        + "; the plan assumed the busiest expert-parallel rank at 1.1x the mean tokens, which a balanced router gives"
    )
    return args


def published_aux_loss(shape: Shape) -> float:
    """The load-balancing loss coefficient the model's own config.json gives (router_aux_loss_coef:
    Mixtral 0.02, Qwen3-MoE 0.001), found by its shape; 0.01 (Megatron-LM's examples') otherwise."""
    name = next((n for n, p in PRESETS.items() if p == shape), None)
    return PUBLISHED_AUX_LOSS.get(name, 0.01)


def export_megatron(
    shape: Shape,
    lay: PlannerLayout,
    wl: Workload,
    optimizer: Optimizer | None = None,
    grad_clip: float | None = None,
    steps: int | None = None,
    moe_aux_loss_coeff: float | None = None,
    fp8_recipe: str | None = None,
) -> tuple[str, list[str]]:
    """Megatron-LM's pretrain_gpt.py arguments for the layout, the model's shape, the optimizer and the
    run's length (`steps`, the harness's default run where None), on mock data so that it launches as
    written (pretrain_gpt.py stops without --train-iters, a tokenizer and data)."""
    opt, clip = optimizer_and_clip(optimizer, grad_clip)
    backend = MEGATRON_ATTENTION[lay.attention]
    args = ["--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp]
    if lay.cp > 1:
        args += ["--context-parallel-size", lay.cp, "--cp-comm-type", CP_COMM[lay.cp_impl]]
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    notes = [f"for {VERSION}"]
    if shape.moe:
        args += _megatron_moe(shape, lay, notes, moe_aux_loss_coeff)
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
    if lay.precision == "fp8":
        recipe = fp8_recipe or "tensorwise"
        args += ["--fp8-format", TE_FORMAT[recipe], "--fp8-recipe", TE_RECIPE[recipe]]
        if fp8_recipe == "rowwise":
            notes.append(
                "FP8 rowwise: Transformer Engine has no rowwise recipe; --fp8-recipe blockwise is its finer-grained "
                "one (1x128 activation and gradient tiles, 128x128 weight blocks; Hopper or later)"
            )
        if fp8_recipe == "rowwise_with_gw_hp":
            notes.append(
                "FP8 rowwise_with_gw_hp: Transformer Engine has no such recipe; --fp8-recipe blockwise computes the "
                "weight gradient in FP8 too (Megatron-core's fp8_wgrad=False, --no-fp8-wgrad, reaches delayed scaling "
                "only); the fp32 accumulation into main_grad is Megatron-core's gradient_accumulation_fusion"
            )
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
    steps = SpecWorkload().steps if steps is None else steps
    args += ["--train-iters", steps, "--eval-iters", 0]
    # mock data and a tokenizer that needs no files: the vocabulary is --vocab-size (NullTokenizer adds
    # an end-of-document id; Megatron-LM pads to a multiple of 128 x tp)
    args += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", shape.vocab]
    notes.append(
        f"--train-iters {steps} (the workload's steps) on --mock-data with NullTokenizer --vocab-size {shape.vocab}: "
        "replace them with your --data-path and tokenizer; Megatron-LM pads the vocabulary to "
        f"{-(-(shape.vocab + 1) // (128 * lay.tp)) * 128 * lay.tp} rows (a multiple of 128 x tp)"
    )
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
    if lay.tp > 1 or lay.cp > 1:  # validate_args asserts it with tp or cp before Blackwell (arguments.py:1477)
        notes.append(
            "launch with CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment: Megatron-LM requires it with tp or cp"
        )
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
