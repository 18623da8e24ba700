"""Build engine megatron (engine.py: Megatron-core itself, on CPU through shim.py). Imports the engine only when
called, so that reading the facts stays light."""

from __future__ import annotations

from harness.spec import check_world_size


def build(spec, shape, ctx):
    from harness.frameworks.megatron.engine import MegatronEngine

    check_world_size(spec, ctx.world_size)
    return MegatronEngine(spec, shape, ctx)
