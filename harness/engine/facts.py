"""What the own 3D engine (harness/engine) runs, declared without importing torch; adapter.py builds it."""

from __future__ import annotations

from harness.registry import EVERY_ENGINE, EngineFacts, MemoryModel, every_value, only, tied_across_stages

BLOCK_KERNELS = ("naive", "sdpa")  # what ring and allgather blocks compute (sdpa: on CPU only)


def blockwise_cp(lay) -> bool:
    return lay.cp > 1 and lay.cp_impl in ("ring", "allgather")


ENGINE = EngineFacts(
    name="own",
    memory=MemoryModel("megatron", vocab_parallel_loss=True),
    honours={
        **EVERY_ENGINE,
        **{
            f"layout.{name}": every_value(f"layout.{name}")
            for name in (
                "tp pp dp cp cp_impl activation_checkpointing sequence_parallel attention rmsnorm "
                "pipeline_schedule virtual_stages pipeline_p2p dp_bucket_mb compile"
            ).split()
        },
        "layout.zero_stage": only(0, 1, why="the own engine has ZeRO stage 0 or 1"),
    },
    capabilities=[
        # ring and allgather run their blocks with naive's masked fp32 math, or sdpa's CPU flash
        # kernel (harness.engine.context_parallel); ulysses runs any kernel on its head shard
        (
            "attention",
            lambda lay: not blockwise_cp(lay) or lay.attention in BLOCK_KERNELS,
            "the own engine's context parallelism with cp_impl ring or allgather computes attention "
            "blocks with naive's fp32 math or sdpa's CPU flash kernel: it needs attention naive or sdpa",
        )
    ],
    model_limits=[
        tied_across_stages(
            "tied embeddings with pp > 1 or virtual stages: the own engine ties the embedding and LM head only when "
            "one model chunk holds both",
            "the own engine",
            lambda s, lay: not s.tie_embeddings or lay.pp * lay.virtual_stages == 1,
        )
    ],
    label=lambda lay: f"own ZeRO-{lay['zero_stage']}" if lay.get("zero_stage") else "own",
    tracer="harness.memtrace.own",
)
