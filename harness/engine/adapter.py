"""Build the own 3D engine (engine.py); what it runs is facts.py. Imports the engine only when called, so that
reading the facts stays light."""

from __future__ import annotations

from harness.spec import check_world_size


def build(spec, shape, ctx):
    from harness.engine.engine import Engine3D

    check_world_size(spec, ctx.world_size)
    return Engine3D(spec, shape, ctx)
