"""What engine fsdp, native PyTorch (FSDP2, DTensor TP/SP, torch.distributed.pipelining), runs:
declared without importing torch; adapter.py builds engine.py."""

from __future__ import annotations

from harness import spec
from harness.registry import EngineFacts, MemoryModel, not_both, only, tied_across_stages
from harness.spec import (
    EVERY_ENGINE,
    FP8,
    MOE,
    MUON,
    MXFP8,
    SELECTIVE_OP_COMPILE,
    SELECTIVE_OP_FP8,
    honoured,
    micro_batch_count,
    some,
    subset,
    through,
)


def _micro(w, lay) -> int:
    return micro_batch_count(w.global_batch_size, lay.dp, lay.micro_batch_size)


# harness names of the torch.distributed.pipelining schedules engine fsdp runs (fsdp/pipeline.py maps them)
SCHEDULES = through(spec.SCHEDULES, "dualpipev")
SPLIT_BACKWARD = subset(SCHEDULES, "zero_bubble", "zbv", "dualpipev")  # input and weight gradients computed apart


# Expert parallelism (fsdp/experts.py), checked against the reference here with dp, dp > ep, full checkpointing,
# bf16, fp8 (tensorwise with and without fp8_all_gather, rowwise, mxfp8; not with pp) and pp (1F1B, ZBV: an ep
# group's ranks are one stage's, running the same schedule, so their all-to-alls pair up in order); the rest
# refused until they are
EP_RULES = [
    (
        "compile",
        lambda lay: lay.ep == 1 or lay.compile == "none",
        "engine fsdp's expert dispatch (all-to-all splits read from the routing) runs eager: use compile none with ep",
    )
]
EP_POLICY = [
    (
        "precision",
        lambda w, lay: lay.ep == 1 or lay.pp == 1 or w.precision != "fp8",
        "fp8 with ep > 1 and pp > 1 under engine fsdp: the FP8 experts of a pipeline stage are not checked against "
        "the reference here (dp and ep are, tests/test_fsdp_moe.py); set pp=1 or precision bf16",
    )
]

CP_IMPLS = (
    "torch's context_parallel exchanges K/V by all-gather or a ring (all-to-all rotation), not Ulysses: "
    "set cp_impl allgather or ring"
)

ENGINE = EngineFacts(
    name="fsdp",
    memory=MemoryModel("fsdp"),
    process_group=True,
    honours={
        **EVERY_ENGINE,
        **FP8,
        **MXFP8,  # harness/model/mxfp8.py
        **MUON,  # harness/model/muon.py: each DTensor matrix's update gathered whole (full_tensor) for Newton-Schulz
        **MOE,  # the plain model's MoEFeedForward: the reference's router and losses (engine.py)
        **honoured(
            "layout",
            "tp pp dp cp ep sequence_parallel virtual_stages reshard_after_forward fp8_all_gather",
            activation_checkpointing="selective_op",
            attention="flash2",
            rmsnorm="fused",
            compile="blocks",
        ),
        "layout.pipeline_schedule": only(
            *SCHEDULES, why="torch.distributed.pipelining's schedules here: " + ", ".join(SCHEDULES)
        ),
        "layout.cp_impl": some("layout.cp_impl", "allgather", "ring", why=CP_IMPLS),
        "layout.zero_stage": only(0, 3, why="fsdp shards by reshard_after_forward, leave zero_stage unset"),
    },
    runs_moe=True,
    capabilities=[
        SELECTIVE_OP_COMPILE,
        *EP_RULES,
        (
            "activation_checkpointing",
            lambda lay: lay.activation_checkpointing != "selective_op" or (lay.tp == 1 and lay.cp == 1),
            "selective_op with tp or cp > 1 under engine fsdp: DTensor's collectives inside a block would run again "
            "in recomputation (the per-op policy, harness/model/op_checkpoint.py, saves none): set tp=1 and cp=1",
        ),
        (
            "compile",
            lambda lay: lay.compile == "none" or lay.tp == 1,
            "compile: blocks with DTensor tensor parallelism (tp > 1) does not reproduce the reference here: its "
            "losses drift from the second step (1.6e-3 relative at the third, fp32, torch 2.13 on CPU; AOTAutograd's, "
            "as backend aot_eager drifts alike and dynamo alone does not) while dp2 and pp2 match to 1e-7; set tp=1 "
            "or compile: none",
        ),
        (
            "attention",
            lambda lay: lay.cp == 1 or lay.attention.startswith("sdpa"),
            "torch's context_parallel replaces F.scaled_dot_product_attention only: set attention sdpa (or sdpa_*)",
        ),
        not_both(
            "cp",
            "pp",
            "engine fsdp's context parallelism is not built with torch.distributed.pipelining: set pp=1 with cp > 1",
        ),
        not_both(
            "cp",
            "tp",
            "engine fsdp's context parallelism is not built with DTensor tensor parallelism: set tp=1 with cp > 1",
        ),
        (
            "reshard_after_forward",
            lambda lay: lay.pp == 1 or lay.pipeline_schedule not in SPLIT_BACKWARD or not lay.reshard_after_forward,
            "torch's zero-bubble schedules split the backward (stage_backward_input, then stage_backward_weight) and "
            "under FSDP2 with reshard_after_forward: true the deferred weight gradients miss the blocks' post-backward "
            "(measured here, torch 2.13, pp2 gloo: losses off the reference from the second step); set "
            "reshard_after_forward: false",
        ),
        (
            "virtual_stages",
            lambda lay: lay.virtual_stages == 1 or lay.pp > 1,
            "engine fsdp places virtual stages on pipeline ranks (torch.distributed.pipelining): needs pp > 1",
        ),
    ],
    precision_limits=[
        SELECTIVE_OP_FP8,
        *EP_POLICY,
        (
            "optimizer.name",
            lambda w, lay: w.optimizer.name != "muon" or lay.tp == 1,
            "muon with tp > 1 under engine fsdp: the Muon step here gathers each matrix over the FSDP2 shard mesh "
            "only, not over DTensor tensor parallelism: set tp=1",
        ),
        (
            "precision",
            lambda w, lay: w.precision != "fp8" or lay.tp == 1,
            "fp8 with tp > 1 under engine fsdp needs torchao's Float8 tensor-parallel styles in the DTensor plan "
            "(Float8ColwiseParallel, Float8RowwiseParallel), not wired here: set tp=1",
        ),
        (
            "grad_accum_dtype",
            lambda w, lay: not (w.grad_accum_dtype == "bf16" and w.grad_reduce_dtype == "fp32"),
            "FSDP2 accumulates gradients over micro-batches either in the fp32 sharded gradient (reducing every "
            "micro-batch) or unreduced in MixedPrecisionPolicy.reduce_dtype (torch/distributed/fsdp/_fully_shard/"
            "_fsdp_param.py, to_accumulated_grad_if_needed): bf16 accumulation with an fp32 reduction is not offered; "
            "set grad_reduce_dtype: bf16 or grad_accum_dtype: fp32",
        ),
        (
            "grad_reduce_dtype",
            lambda w, lay: lay.pp == 1 or w.grad_accum_dtype == w.grad_reduce_dtype,
            "torch.distributed.pipelining defers FSDP2's reduction to the last micro-batch, and FSDP2 accumulates "
            "until then in reduce_dtype: with pp > 1 fp32 accumulation needs grad_reduce_dtype: fp32",
        ),
    ],
    model_limits=[
        tied_across_stages(
            "tied embeddings with pp > 1: torch.distributed.pipelining puts the embedding and LM head on different "
            "stages",
            "engine fsdp",
            lambda s, lay: not s.tie_embeddings or lay.pp == 1,
        ),
        (
            "mixture of experts",
            lambda s, lay: not s.moe or lay.activation_checkpointing != "selective_op",
            "selective_op with a MoE model: the per-op policy counts a dense block's matmuls (wq, wv, w1, w2 saved); "
            "use a dense model or another checkpointing mode",
        ),
        (
            "mixture of experts",
            lambda s, lay: not s.moe or lay.tp == 1,
            "engine fsdp's DTensor tensor-parallel plan (fsdp/tp.py) does not shard the router and experts: set tp=1",
        ),
        (
            "mixture of experts",
            lambda s, lay: not s.moe or lay.cp == 1,
            "the router's losses are not additive over tokens and torch's context_parallel splits each sequence "
            "over cp ranks without summing their router statistics: set cp=1",
        ),
    ],
    # torch's Schedule1F1B takes at least pp micro-batches; ScheduleZBVZeroBubble any (it plans max(2pp - 1, m)
    # and drops the rest: run here from 1 to 4 at pp 2); ScheduleInterleavedZeroBubble's rounds and
    # ScheduleDualPipeV's 2 pp are the spec's own checks (harness/spec/checks.py: the own engine runs them too)
    batch_limits=[
        (
            "pipeline_schedule",
            lambda w, lay: lay.pp == 1 or lay.pipeline_schedule != "1f1b" or _micro(w, lay) >= lay.pp,
            lambda w, lay: (
                f"torch's Schedule1F1B needs at least pp={lay.pp} micro-batches, the workload gives {_micro(w, lay)}"
            ),
        )
    ],
    label=lambda lay: "FSDP2 " + ("reshard" if lay.get("reshard_after_forward", True) else "no-reshard"),
    preflight=lambda spec: check_cp_device(spec),
    tracer="harness.memtrace.fsdp",
)

# What torch 2.13's context_parallel does on CPU (measured here, gloo, 2 ranks): its SDPA dispatch
# knows only the CUDA kernels, and the CPU one has no DTensor sharding strategy.
CPU_REFUSAL = (
    "torch's context_parallel runs on CUDA only: its SDPA dispatch covers the flash, efficient and cuDNN "
    "kernels, and on CPU aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy "
    "(torch 2.13); set cp=1 or run on CUDA"
)


def check_cp_device(spec) -> None:
    """cp > 1 needs the CUDA device its ranks would get (workload.device; auto: CUDA when visible)."""
    from harness.errors import SpecError

    if spec.layout.cp == 1 or spec.workload.device == "cuda":
        return
    if spec.workload.device == "auto":
        import torch

        if torch.cuda.is_available():
            return
    raise SpecError("layout.cp", CPU_REFUSAL)
