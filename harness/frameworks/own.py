"""Adapter for the own 3D-parallel engine (harness/engine)."""

from __future__ import annotations

from harness.frameworks import ONLY_DEEPSPEED, tied_across_stages
from harness.registry import EngineFacts
from harness.spec import check_world_size

ENGINE = EngineFacts(
    name="own",
    capabilities=[("zero_stage", lambda lay: lay.zero_stage in (0, 1), "the own engine has ZeRO stage 0 or 1"),
                  # ring and allgather compute attention blockwise in fp32 with explicit masks (naive's math)
                  ("attention", lambda lay: lay.cp == 1 or lay.cp_impl == "ulysses" or lay.attention == "naive",
                   "the own engine's context parallelism with cp_impl ring or allgather computes attention in "
                   "fp32 blocks with explicit masks, as attention naive does: it needs attention naive"),
                  *ONLY_DEEPSPEED],
    model_limits=[tied_across_stages(
        "tied embeddings with pp > 1 or virtual stages: the own engine ties the embedding and LM head only when "
        "one model chunk holds both", "the own engine",
        lambda s, lay: not s.tie_embeddings or lay.pp * lay.virtual_stages == 1)],
    label=lambda lay: f"own ZeRO-{lay['zero_stage']}" if lay.get("zero_stage") else "own",
)


def build(spec, shape, ctx):
    from harness.engine.engine import Engine3D

    check_world_size(spec, ctx.world_size)
    return Engine3D(spec, shape, ctx)
