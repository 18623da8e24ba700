"""`harness plan`'s recipe flags (harness/commands/plan_recipe.py): each sets its PlannerLayout field on every
candidate, so that a plan with a published recipe's settings predicts that recipe's row as the published-runs
check does; each is refused in one line (exit 2) where the engine planned has no such setting, no candidate
would use it, or an export would drop it."""

from __future__ import annotations

import json

import pytest

from harness.cli import main as cli
from harness.planner.published import load, memory_check

# Megatron-Bridge 25.11's Llama 3 70B on 64 H100 (baselines/published_runs/runs.csv), narrowed to its kernels
PLAN = ["plan", "--model", "llama3-70b", "--seq-len", "8192", "--global-batch-size", "128", "--gpus", "64"]
PLAN += ["--hardware", "h100-sxm", "--engine", "megatron", "--precision", "fp8", "--attention", "te_fused"]
PLAN += ["--rmsnorm", "fused", "--micro-batch-sizes", "1", "--activation-checkpointing", "none", "--format", "json"]
RECIPE = ["--fp8-params", "--main-grads", "bf16", "--fused-swiglu", "--loss-fusion", "--te-attention"]


def _row_memory(rows) -> float:
    (row,) = [r for r in rows if (r["tp"], r["pp"], r["virtual_stages"], r["sequence_parallel"]) == (4, 8, 5, True)]
    return row["memory_gib"]


def test_the_recipes_flags_plan_its_row_as_the_published_check_predicts_it(no_launch, capsys):
    assert cli(PLAN) == 0
    without = _row_memory(json.loads(capsys.readouterr().out))
    assert cli([*PLAN, *RECIPE]) == 0
    with_recipe = _row_memory(json.loads(capsys.readouterr().out))
    rows = [r for r in load() if r.row["model"] == "LLAMA3_70B" and r.row["system"] == "DGX-H100"]
    (run,) = [r for r in rows if r.row["settings"]]
    assert with_recipe == pytest.approx(memory_check(run).predicted_gib, abs=0.01)
    assert with_recipe < without - 5  # the recipe's terms are GiB each, not rounding


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--engine", "fsdp", "--fp8-params"], "--fp8-params: a setting of engine megatron, not of fsdp"),
        (["--precision", "bf16", "--fp8-params"], "--fp8-params: fp8 primary weights need --precision fp8"),
        (["--recompute-layers", "5"], "--recompute-layers: recomputes under full checkpointing"),
        (["--activation-checkpointing", "full", "--recompute-layers", "81"], "takes 1 to the model's 80 layers"),
        (["--expert-tp", "1"], "--expert-tp: llama3-70b has no experts"),
        (["--moe-balanced"], "--moe-balanced: llama3-70b has no experts"),
        (["--engine", "megatron", "--pp-outputs-kept"], "--pp-outputs-kept: a setting of engine fsdp"),
        (["--engine", "fsdp", "--expandable-segments"], "--expandable-segments: the planner's memory reads it"),
        (["--loss-fusion", "--export", "megatron"], "--export: the recipe settings (loss_fusion) are planned"),
    ],
)
def test_a_recipe_flag_the_plan_cannot_use_is_refused(no_launch, one_line_error, extra, words):
    line = one_line_error(cli([*PLAN, *extra]))
    assert line.startswith("error: --") and words in line


def test_expandable_segments_takes_the_merged_outputs_segment_off_a_pipelines_last_stage(no_launch, capsys):
    """--pp-outputs-kept's merged outputs take a segment of their own (harness/planner/memory_reserve.py) but under
    --expandable-segments, where the step's end leaves the one segment's tail free for them."""
    plan = ["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch-size", "32", "--gpus", "16"]
    plan += ["--hardware", "h100-sxm", "--engine", "fsdp", "--attention", "sdpa_flash", "--rmsnorm", "torch"]
    plan += ["--micro-batch-sizes", "1", "--activation-checkpointing", "full", "--format", "json", "--pp-outputs-kept"]
    memory = []
    for extra in ([], ["--expandable-segments"]):
        assert cli([*plan, *extra]) == 0
        rows = json.loads(capsys.readouterr().out)
        memory.append({(r["tp"], r["pp"], r["dp"], r["pipeline_schedule"]): r["memory_gib"] for r in rows})
    kept, grown = memory
    assert kept.keys() == grown.keys()
    assert all(grown[k] <= kept[k] for k in kept)
    assert any(grown[k] < kept[k] - 1 for k in kept if k[1] > 1)  # a pipeline's merged logits: GiB, not rounding
    assert all(grown[k] == kept[k] for k in kept if k[1] == 1)
