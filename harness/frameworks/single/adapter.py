"""Build engine single, the one-process reference (engine.py). Imports the engine only when called, so that
reading the facts stays light."""

from __future__ import annotations

from harness.errors import SpecError


def build(spec, shape, ctx):
    from harness.frameworks.single.engine import SingleDeviceEngine

    if ctx.world_size != 1:
        raise SpecError("layout.engine", "single runs in one process; use own, deepspeed or fsdp for more")
    return SingleDeviceEngine(spec, shape, ctx.device)
