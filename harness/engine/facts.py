"""What the own 3D engine (harness/engine) runs, declared without importing torch; adapter.py builds it."""

from __future__ import annotations

from harness import spec
from harness.registry import EngineFacts, MemoryModel, only, tied_across_stages
from harness.spec import (
    EVERY_ENGINE,
    FP8,
    MOE,
    MUON,
    MXFP8,
    SELECTIVE_OP_COMPILE,
    SELECTIVE_OP_FP8,
    honoured,
    subset,
    through,
)

# its instruction lists (harness/engine/schedules.py; the zero-bubble ones in torch's orders, zero_bubble.py)
SCHEDULES = through(spec.SCHEDULES, "dualpipev")
# what ring and allgather blocks compute: naive's math, or torch's attention ops that return the LSE
# (harness.engine.lse_attention: flash on CPU; flash, efficient, cuDNN on CUDA; whether the device runs
# the kernel is the kernel check's verdict before launch, harness.model.kernels.check_kernels)
BLOCK_KERNELS = subset(spec.ATTENTION_KERNELS, "naive", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
BLOCKWISE_CP = subset(spec.CP_IMPLS, "ring", "allgather")  # K/V blocks, each attended to apart


def blockwise_cp(lay) -> bool:
    return lay.cp > 1 and lay.cp_impl in BLOCKWISE_CP


def fp8_misaligned_shards(w, lay) -> list[str]:
    """The sharded widths of the linears under tp that are not multiples of 16 (torch._scaled_mm's; 32, the
    scale block, under mxfp8: harness.model.float8.align)."""
    from harness.model.float8 import align
    from harness.model.presets import resolve_shape

    s = resolve_shape(w.model, w.model_overrides)
    head_dim = s.head_dim
    widths = {"ffn": s.ffn, "q heads": s.heads * head_dim, "kv heads": s.kv_heads * head_dim}
    if s.moe:  # each expert's SwiGLU is split over tp as the dense one is (harness/engine/experts.py)
        widths["moe_ffn"] = s.moe_ffn
    n = align(w.fp8_recipe)
    return [k for k, v in widths.items() if v % n == 0 and (v // lay.tp) % n]


ENGINE = EngineFacts(
    name="own",
    memory=MemoryModel("megatron", vocab_parallel_loss=True),
    honours={
        **EVERY_ENGINE,
        **FP8,
        **MXFP8,  # harness/model/mxfp8.py
        **MOE,
        **MUON,  # harness/model/muon.py; ZeRO-1 gathers each sharded matrix's update for Newton-Schulz
        **honoured(
            "layout",
            "tp pp dp cp ep sequence_parallel virtual_stages dp_bucket_mb",
            cp_impl="ulysses",
            activation_checkpointing="selective_op",
            attention="flash2",
            rmsnorm="fused",
            pipeline_p2p="grouped",
            compile="blocks",
        ),
        "layout.pipeline_schedule": only(
            *SCHEDULES,
            why="the own engine's instruction lists (harness/engine/schedules.py) are " + ", ".join(SCHEDULES),
        ),
        "layout.zero_stage": only(0, 1, why="the own engine has ZeRO stage 0 or 1"),
    },
    capabilities=[
        SELECTIVE_OP_COMPILE,
        (
            "activation_checkpointing",
            lambda lay: lay.activation_checkpointing != "selective_op" or (lay.tp == 1 and lay.cp == 1),
            "selective_op with tp or cp > 1: the own engine's TP and CP collectives run inside a block, and the "
            "per-op policy (harness/model/op_checkpoint.py) saves no collective's output, so recomputation would "
            "repeat them: set tp=1 and cp=1, or activation_checkpointing selective",
        ),
        # ring and allgather run their blocks with naive's masked fp32 math or an op that returns the
        # LSE (harness.engine.context_parallel); ulysses runs any kernel on its head shard
        (
            "attention",
            lambda lay: not blockwise_cp(lay) or lay.attention in BLOCK_KERNELS,
            "the own engine's context parallelism with cp_impl ring or allgather computes attention "
            "blocks with naive's fp32 math or torch's SDPA ops that return the log-sum-exp: it needs "
            "attention naive, sdpa, sdpa_flash, sdpa_efficient or sdpa_cudnn (or cp_impl ulysses)",
        ),
    ],
    model_limits=[
        tied_across_stages(
            "tied embeddings with pp > 1 or virtual stages: the own engine ties the embedding and LM head only when "
            "one model chunk holds both",
            "the own engine",
            lambda s, lay: not s.tie_embeddings or lay.pp * lay.virtual_stages == 1,
        ),
        # what the own engine's MoE (harness/engine/experts.py) is not built for
        (
            "mixture of experts",
            lambda s, lay: not s.moe or lay.activation_checkpointing != "selective_op",
            "selective_op with a MoE model: the policy saves matmuls by their order in a dense block, and the "
            "own engine's expert all-to-alls would run again in recomputation: use a dense model or another mode",
        ),
        (
            "a compiled MoE",
            lambda s, lay: not s.moe or lay.compile == "none",
            "the own engine's MoE (data-dependent all-to-all splits) runs eager: use compile none",
        ),
    ],
    precision_limits=[
        SELECTIVE_OP_FP8,
        (
            "optimizer.name",
            lambda w, lay: w.optimizer.name != "muon" or lay.tp == 1,
            "muon with tp > 1: Newton-Schulz needs each whole matrix and the own engine's Muon gathers the ZeRO-1 "
            "shards over dp only, not a tensor-parallel shard over tp: set tp=1",
        ),
        (
            "precision",
            lambda w, lay: w.precision != "fp8" or lay.tp == 1 or not fp8_misaligned_shards(w, lay),
            "fp8 with tp > 1: the own engine's FP8 GEMMs run on each rank's shard, and torch._scaled_mm needs its "
            "dims multiples of 16 (32 under mxfp8: harness/model/float8.py); a shard that is not would leave a "
            "linear the reference runs in FP8 in bf16: choose tp so that ffn/tp (a MoE's moe_ffn/tp too) and the "
            "q/k/v head widths / tp are multiples of 16 (32)",
        ),
        (
            "fp8_recipe",
            lambda w, lay: (
                w.precision != "fp8" or w.fp8_recipe != "rowwise_with_gw_hp" or lay.pipeline_schedule != "zbv"
            ),
            "rowwise_with_gw_hp with pipeline_schedule zbv: the split backward runs an FP8 linear's backward once for "
            "the input gradient and again for the weight's, and this recipe adds its weight gradient into the fp32 "
            "main gradient in that backward (harness/model/float8.py): use another schedule or recipe",
        ),
    ],
    runs_moe=True,
    label=lambda lay: f"own ZeRO-{lay['zero_stage']}" if lay.get("zero_stage") else "own",
    tracer="harness.memtrace.own",
)
