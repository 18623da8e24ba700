"""Build the own 3D engine (engine.py); what it runs is facts.py. Imports the engine only when called, so that
reading the facts stays light."""

from __future__ import annotations

from harness.engine.facts import blockwise_cp
from harness.errors import CapabilityError
from harness.spec import check_world_size


def build(spec, shape, ctx):
    from harness.engine.engine import Engine3D

    check_world_size(spec, ctx.world_size)
    lay = spec.layout
    if blockwise_cp(lay) and lay.attention == "sdpa" and ctx.device.type != "cpu":
        # the device is known only here (workload.device auto): refused before anything is built
        raise CapabilityError(
            "layout.attention",
            f"the own engine's cp_impl {lay.cp_impl} runs sdpa blocks only on "
            f"CPU (torch's CPU flash kernel); on {ctx.device.type} use "
            "attention naive or cp_impl ulysses",
        )
    return Engine3D(spec, shape, ctx)
