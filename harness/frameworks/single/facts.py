"""What engine single, the one-process reference every layout and framework is checked against, runs:
declared without importing torch; adapter.py builds it (engine.py)."""

from __future__ import annotations

from harness.registry import EngineFacts, MemoryModel, only
from harness.spec import EVERY_ENGINE, FP8, MOE, MUON, MXFP8, honoured

_ONE_PROCESS = "engine single is one process: set tp=cp=pp=dp=1"
ENGINE = EngineFacts(
    name="single",
    honours={
        **EVERY_ENGINE,
        **FP8,
        **MXFP8,  # harness/model/mxfp8.py
        **MOE,
        **MUON,
        **{f"layout.{name}": only(1, why=_ONE_PROCESS) for name in ("tp", "pp", "dp", "cp")},
        **honoured(
            "layout", activation_checkpointing="selective_op", attention="flash2", rmsnorm="fused", compile="blocks"
        ),
    },
    why_not={"layout.zero_stage": "engine single has no ZeRO"},
    precision_limits=[
        (
            "precision",
            lambda w, lay: w.precision != "fp8" or lay.activation_checkpointing != "selective_op",
            "fp8 with selective_op: the per-op policy counts aten.mm and aten.addmm, and torchao's FP8 linears run "
            "other ops (harness/model/op_checkpoint.py): not checked here; use bf16 or another checkpointing mode",
        )
    ],
    launcher="direct",
    memory=MemoryModel("megatron"),  # the reference's policy is the own engine's (Megatron-style)
    one_process=True,
    runs_moe=True,
)
