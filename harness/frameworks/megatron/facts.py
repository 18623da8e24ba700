"""What engine megatron, Megatron-core itself (GPTModel on its local layer spec, parallel_state,
its schedules, DistributedDataParallel and DistributedOptimizer), runs: declared without importing
torch or Megatron; adapter.py builds engine.py (on CPU through shim.py)."""

from __future__ import annotations

import importlib.util

from harness.registry import ANY, EngineFacts, MemoryModel, only
from harness.spec import EVERY_ENGINE, MOE, honoured, some

# Megatron-core's llama3 rope scaling takes only the factor; the rest is fixed
# (models/common/embeddings/rotary_pos_embedding.py, RotaryEmbedding._apply_scaling).
LLAMA3_FIXED = (1.0, 4.0, 8192)


def _chunks(lay) -> int:
    return lay.pp * (lay.virtual_stages if lay.pipeline_schedule == "interleaved" else 1)


# ---- mixture of experts (Megatron's MoELayer: megatron/layer_spec.py moe_config, megatron/routers.py)
# What Megatron's MoELayer cannot be made to run as harness.model.moe does: (what, takes(shape, lay), why).
MOE_LIMITS = [
    (
        "experts",
        lambda s, lay: not s.moe or lay.tp == 1 or lay.sequence_parallel,
        "Megatron-core's MoELayer trains under tp > 1 only with sequence parallelism (moe_layer.py raises "
        "otherwise); set sequence_parallel: true",
    ),
    (
        "experts_per_token",
        lambda s, lay: not s.moe or s.experts_per_token > 1 or not s.norm_topk,
        "top-1 routing renormalised (weight 1) has no Megatron-core router: it needs moe_router_pre_softmax "
        "with k=1, which keeps the softmax weight",
    ),
]

_TE = "importable here, not wired" if importlib.util.find_spec("transformer_engine") else "not importable here"

ENGINE = EngineFacts(
    name="megatron",
    memory=MemoryModel("megatron", layer_split="even", vocab_parallel_loss=True, sp_regathers=True),
    process_group=True,
    runs_moe=True,
    honours={
        **EVERY_ENGINE,
        **MOE,  # Megatron's aux_loss and z-loss are the reference's (layer_spec.moe_config)
        "layout.ep": ANY,
        "workload.precision": some(
            "workload.precision",
            "fp32",
            "bf16",
            why="Megatron-core runs FP8 only through Transformer Engine's layers (fp8_autocast), and engine megatron "
            f"builds its local layer spec without them (Transformer Engine {_TE}): engine megatron runs fp32 or bf16",
        ),
        **honoured("layout", "tp pp dp sequence_parallel virtual_stages", activation_checkpointing="selective"),
        "layout.zero_stage": only(
            0,
            1,
            why=(
                "engine megatron has DistributedDataParallel (zero_stage 0) and its DistributedOptimizer "
                "(zero_stage 1); ZeRO-2/3 is Megatron-FSDP, not run here"
            ),
        ),
        "layout.cp": only(
            1,
            why=(
                "Megatron-core's context parallelism (cp_comm_type p2p, all_gather, a2a) runs only in Transformer "
                "Engine's attention (TEDotProductAttention), not installed here: engine megatron runs cp=1"
            ),
        ),
        "layout.attention": some(
            "layout.attention",
            "naive",
            why=(
                "Megatron-core's local layer spec (no Transformer Engine) has one core attention, "
                "DotProductAttention: softmax(QK^T)V materialised, softmax in fp32 (what naive is); set attention: "
                "naive"
            ),
        ),
        "layout.rmsnorm": some(
            "layout.rmsnorm",
            "torch",
            why=(
                "Megatron-core's fused RMSNorm needs Transformer Engine or Apex; engine megatron runs the eager one "
                "(torch)"
            ),
        ),
        "layout.pipeline_schedule": some(
            "layout.pipeline_schedule",
            "1f1b",
            "interleaved",
            why=(
                "Megatron-core's schedules are 1F1B and interleaved 1F1B (get_forward_backward_func): no gpipe, "
                "no zero-bubble or V schedules"
            ),
        ),
    },
    why_not={
        "workload.optimizer.name": "Megatron-core's Muon (TensorParallelMuon: 0.16 megatron/core/optimizer/muon.py, "
        "0.19 optimizer/emerging_optimizers.py) needs NVIDIA's emerging_optimizers package (Python 3.12+), not a "
        "dependency here: engine megatron runs adamw",
        "layout.compile": "engine megatron runs Megatron-core's layers as it builds them (its own fusions only): "
        "compiling its blocks from outside is not done here",
        "layout.dp_bucket_mb": "Megatron's DDP here runs without overlap, one bucket per buffer (Megatron-LM's "
        "defaults): the own engine's dp_bucket_mb has no counterpart",
    },
    # its one core attention without Transformer Engine is the materialised one (naive)
    defaults={"layout.attention": "naive"},
    capabilities=[
        (
            "virtual_stages",
            lambda lay: lay.pipeline_schedule != "interleaved" or (lay.pp > 1 and lay.virtual_stages > 1),
            "Megatron-core's interleaved schedule needs pp > 1 and virtual_stages > 1 (one chunk per rank is 1F1B)",
        )
    ],
    precision_limits=[
        (
            "grad_accum_dtype",
            lambda w, lay: w.grad_accum_dtype == w.grad_reduce_dtype,
            "Megatron's DDP sums the micro-batches' gradients into its main-gradient buffer and reduces that buffer: "
            "one dtype for both (grad_reduce_in_fp32); set grad_accum_dtype equal to grad_reduce_dtype",
        )
    ],
    model_limits=[
        (
            "rope_scaling",
            lambda s, lay: s.rope_scaling is None or tuple(s.rope_scaling[1:]) == LLAMA3_FIXED,
            "Megatron-core's llama3 rope scaling takes only the factor, with low_freq_factor 1, high_freq_factor 4 "
            "and original_max_position_embeddings 8192 fixed",
        ),
        (
            "layers",
            lambda s, lay: s.layers % _chunks(lay) == 0,
            "engine megatron splits the layers evenly over pp x virtual_stages model chunks",
        ),
        *MOE_LIMITS,
    ],
    label=lambda lay: "megatron DistOpt" if lay.get("zero_stage") else "megatron",
)
