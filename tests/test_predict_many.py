"""The plan's fast path predicts what the reference path does: every candidate of a plan, built as
candidates.layouts builds them (one instance per split, the rest set on its fields), predicted by
predict_many (its caches, its aliases by rate class), equals predict() of the same layout built by
PlannerLayout's own __init__, field for field, breakdowns included, on every engine the planner models
(150 candidates of each plan, spread over it; benchmarks/plan_speed.py --check compares every one)."""

from __future__ import annotations

import dataclasses

import pytest

from harness.model.presets import PRESETS
from harness.planner import candidates
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.predict import predict, predict_many

CASES = [
    # (model, seq, batch, gpus, profile, engine, precisions): cp > 1, pp > 1 with interleaved/V schedules, MoE ep
    ("llama3-8b", 16384, 32, 16, "h100-sxm", "own", ("bf16",)),
    ("llama3-8b", 8192, 64, 16, "h100-sxm", "megatron", ("bf16", "fp8")),
    ("llama3-8b", 8192, 64, 16, "h200", "fsdp", ("bf16", "fp8")),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "deepspeed", ("bf16",)),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "paper", ("bf16",)),
    ("qwen3-30b-a3b", 4096, 128, 16, "h100-sxm", "own", ("bf16",)),
]


@pytest.mark.parametrize(
    "model, seq, batch, gpus, hw, engine, precisions", CASES, ids=[c[5] + "-" + c[0] for c in CASES]
)
def test_every_candidate_predicted_as_one_call_each(model, seq, batch, gpus, hw, engine, precisions):
    shape, prof, wl = PRESETS[model], load_profile(hw), Workload(seq, batch)
    lays = list(
        candidates.layouts(
            shape,
            wl,
            gpus,
            prof.gpus_per_node,
            attention=["flash2", "sdpa", "naive"],
            rmsnorm=["fused", "torch"],
            micro_batch_sizes=[1, 2],
            checkpointing=["none", "selective", "full"],
            sequence_parallel=[False, True],
            zero_stage=1,
            precisions=precisions,
            pipeline_schedules=None if engine in ("paper", "deepspeed", "megatron") else ["1f1b", "interleaved", "zbv"],
            engine=engine,
            fsdp=engine == "fsdp",
        )
    )
    assert len(lays) > 50 and len({lay.pp for lay in lays}) > 1
    preds = predict_many(shape, lays, wl, prof)  # every candidate, through its caches and aliases
    step = max(1, len(lays) // 150)  # compared with one call each: 150 of them, spread over the list
    for many, lay in list(zip(preds, lays, strict=True))[::step]:
        again = PlannerLayout(**{f.name: getattr(lay, f.name) for f in dataclasses.fields(PlannerLayout)})
        assert again == lay and hash(again) == hash(lay) and repr(again) == repr(lay)
        assert (again.dims, again.gpus, again.replicas) == (lay.dims, lay.gpus, lay.replicas)
        one = predict(shape, again, wl, prof)
        assert many.layout is lay
        assert dataclasses.asdict(many) == dataclasses.asdict(one), lay
