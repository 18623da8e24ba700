"""The levers as controlled variables in one comparison (examples/compare-cpu-levers.yaml): torch.compile
of every block and the zero-bubble V schedule under the own engine and FSDP2, each against the single-device
reference at fp32's 1e-5 (FP8 has its own comparison under its own reference: tests/test_fp8.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-levers.yaml")
LEVERS = ("own pp2 zbv", "own pp2 compiled", "FSDP2 pp2 zbv", "FSDP2 dp2 compiled")


def test_the_example_s_runs_each_change_one_lever():
    """Every lever run has its baseline in the example, differing in that lever alone (the report's Why
    then explains one change: compute for compile, the bubble for the schedule)."""
    from harness.compare.spec import load_compare_spec

    cs = load_compare_spec(EXAMPLE)
    runs = {r.label: dataclasses.asdict(r.spec.layout) for r in cs.runs}
    pairs = {
        "own pp2 zbv": ("own pp2 1f1b", {"pipeline_schedule"}),
        "own pp2 compiled": ("own pp2 1f1b", {"compile"}),
        "FSDP2 pp2 zbv": ("FSDP2 pp2 1f1b", {"pipeline_schedule"}),
        "FSDP2 dp2 compiled": ("FSDP2 dp2", {"compile"}),
    }
    for lever, (base, field) in pairs.items():
        a, b = runs[lever], runs[base]
        assert {k for k in a if a[k] != b[k]} == field, lever


# The example's 6 measured steps cut to 3 (and 1 profiled step, not 2): parity is a maximum over the steps
# compared, and a recompile shows at the first measured step whose guards fail (3 after the compiling warm-up).
STEPS = 3


@pytest.mark.slow
def test_compiled_and_zero_bubble_runs_match_the_reference(tmp_path):
    """One comparison of the four lever runs (2 processes each) and the reference over STEPS measured steps, fp32:
    compiled blocks differ from eager by the order of their fused reductions only (tests/test_compile.py derives
    3.8e-6 at this width), the V schedule not at all (the same sums, split into B and W), so 1e-5 holds; the compiled
    runs compiled in warm-up and never again, and the schedule ran is the one asked for."""
    from harness.compare.orchestrate import run_comparison
    from harness.store import PASS
    from harness.testing.workloads import example_over

    cs = example_over(EXAMPLE, STEPS)
    cs.runs = [r for r in cs.runs if r.is_reference or r.label in LEVERS]
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, log_dir=str(tmp_path), profile_steps=1
    )
    assert all(len(losses) == 1 + STEPS for losses in summary["loss_curves"].values())  # warm-up + measured
    assert summary["verdict"] == PASS, [(r["label"], r["status"], r.get("error_line")) for r in summary["runs"]]
    assert cs.tolerance == 1e-5 and len(summary["runs"]) == 1 + len(LEVERS)
    for r in summary["runs"]:
        m = r["metrics"]
        if "compiled" in r["label"]:
            assert m["compile"]["compile_s"] > 0 and m["compile"]["recompiles_after_warmup"] == 0
        if "zbv" in r["label"]:  # the own engine's instruction lists, torch's ScheduleZBVZeroBubble under fsdp
            ran = r["describe"]["schedule"] if r["engine"] == "own" else r["describe"]["pipeline"]["schedule"]
            assert ran in ("zbv", "ScheduleZBVZeroBubble"), ran
