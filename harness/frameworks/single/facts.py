"""Adapter for engine single, the one-process reference every layout and framework is checked
against: what it runs, declared without importing torch; the engine is single/engine.py."""

from __future__ import annotations

from harness.registry import ONLY_DEEPSPEED, ONLY_OWN, EngineFacts

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
