"""Build engine deepspeed: its ZeRO engine (engine.py: ZeRO, AutoTP, Ulysses) or, with pp > 1, its pipeline
engine (pipe.py). Imports the engine only when called, so that reading the facts stays light."""

from __future__ import annotations

import os

from harness.spec import check_world_size


def build(spec, shape, ctx):
    check_world_size(spec, ctx.world_size)
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
    if spec.layout.pp > 1:
        from harness.frameworks.deepspeed.pipe import DeepSpeedPipelineEngine

        return DeepSpeedPipelineEngine(spec, shape, ctx)
    from harness.frameworks.deepspeed.engine import DeepSpeedEngine

    return DeepSpeedEngine(spec, shape, ctx)
