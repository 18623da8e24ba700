"""The planner's FP8 / BF16 speed-up at the layouts of the published FP8-BF16 pairs in
baselines/published_runs/runs.csv (Llama 3 8B on 8 H100), beside the published ratio: a check, not a fit
(the profile's literature constants; the efficiencies are fitted elsewhere across all rows).

Each pair as its source ran it: dgxc (NeMo 24.09, Transformer Engine: engine megatron, cuDNN fused
attention, tp1 cp2 dp4, micro-batch 1, batch 128); torchtitan (FSDP2 over 8, local batch 2, selective
checkpointing, seq 8192: its 8B default; bf16 with torch.compile against Float8 with compile); torchao's
float8 README (FSDP2 over 8, local batch 1, per-op SAC as selective, tensorwise with fp8 all-gather; and
rowwise, predicted with the planner's fp8.RECIPE set to rowwise: its casts, no fp8 all-gather, the same
gemm_fp8, since the planner has no efficiency of rowwise-scaled GEMMs).
Printed twice: with the allocator-pressure term (its prior was fitted on the study's A100 sweeps) and
without it, since at these small batches it is a large share of the predicted step.

    python benchmarks/plan_fp8_pairs.py
"""

from __future__ import annotations

import dataclasses

from harness.model.presets import resolve_shape
from harness.planner import fp8
from harness.planner.features import theta_from_profile
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.predict import predict

PAIRS = (  # label, layout, workload, published bf16 and fp8 tokens/s per GPU
    (
        "dgxc 8B megatron tp1 cp2 dp4 mb1",
        PlannerLayout(1, 1, 4, 1, cp=2, engine="megatron", attention="te_fused"),
        Workload(8192, 128),
        10152.75,
        13554.5,
    ),
    (
        "torchtitan 8B fsdp8 mb2 selective",
        PlannerLayout(1, 1, 8, 2, activation_checkpointing="selective", engine="fsdp", fsdp=True, attention="sdpa"),
        Workload(8192, 16),
        6667,
        8532,
    ),
    (
        "torchao 8B fsdp8 mb1 SAC tensorwise+fp8 AG",
        PlannerLayout(1, 1, 8, 1, activation_checkpointing="selective", engine="fsdp", fsdp=True, attention="sdpa"),
        Workload(8192, 8),
        6150,
        7689.5,
    ),
    (
        "torchao 8B fsdp8 mb1 SAC rowwise",
        PlannerLayout(1, 1, 8, 1, activation_checkpointing="selective", engine="fsdp", fsdp=True, attention="sdpa"),
        Workload(8192, 8),
        6150,
        6768,
    ),
)


def main() -> None:
    prof = load_profile("h100-sxm")
    shape = resolve_shape("llama3-8b")
    no_pressure = {**theta_from_profile(prof), "alloc_pressure_s": 0.0}
    print(f"{'pair':44} {'bf16 tok/s/GPU':>15} {'fp8':>7} {'ratio':>6} {'w/o alloc':>9} {'published':>9}")
    for label, lay, wl, pub_bf16, pub_fp8 in PAIRS:
        fp8.RECIPE = "rowwise" if "rowwise" in label else "tensorwise"
        f8 = dataclasses.replace(lay, precision="fp8")
        b, f = predict(shape, lay, wl, prof), predict(shape, f8, wl, prof)
        b0, f0 = predict(shape, lay, wl, prof, no_pressure), predict(shape, f8, wl, prof, no_pressure)
        print(
            f"{label:44} {b.tokens_per_s / lay.gpus:15.0f} {f.tokens_per_s / lay.gpus:7.0f} "
            f"{f.tokens_per_s / b.tokens_per_s:6.3f} {f0.tokens_per_s / b0.tokens_per_s:9.3f} {pub_fp8 / pub_bf16:9.3f}"
        )


if __name__ == "__main__":
    main()
