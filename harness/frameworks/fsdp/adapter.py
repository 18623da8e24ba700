"""Build engine fsdp (engine.py: FSDP2, DTensor TP/SP, torch.distributed.pipelining). Imports the engine only
when called, so that reading the facts stays light."""

from __future__ import annotations

from harness.spec import check_world_size


def build(spec, shape, ctx):
    from harness.frameworks.fsdp.engine import FSDPEngine

    check_world_size(spec, ctx.world_size)  # (1F1B with too few micro-batches: refused by the spec)
    return FSDPEngine(spec, shape, ctx)
