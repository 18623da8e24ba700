"""Adapter for engine single, the one-process reference every layout and framework is checked
against: what it runs, declared without importing torch; the engine is single_engine.py."""

from __future__ import annotations

from harness.errors import SpecError
from harness.frameworks import ONLY_DEEPSPEED, ONLY_OWN
from harness.registry import EngineFacts

_ONE_PROCESS = "engine single is one process: set tp=cp=pp=dp=1"
ENGINE = EngineFacts(
    name="single",
    capabilities=[("tp", lambda lay: lay.tp == 1, _ONE_PROCESS), ("pp", lambda lay: lay.pp == 1, _ONE_PROCESS),
                  ("dp", lambda lay: lay.dp == 1, _ONE_PROCESS), ("cp", lambda lay: lay.cp == 1, _ONE_PROCESS),
                  ("zero_stage", lambda lay: lay.zero_stage == 0, "engine single has no ZeRO"),
                  *ONLY_DEEPSPEED, *ONLY_OWN],
    launcher="direct",
    one_process=True,
)


def build(spec, shape, ctx):
    from harness.frameworks.single_engine import SingleDeviceEngine

    if ctx.world_size != 1:
        raise SpecError("layout.engine", "single runs in one process; use own, deepspeed or fsdp for more")
    return SingleDeviceEngine(spec, shape, ctx.device)
