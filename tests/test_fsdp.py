"""FSDP2: both reshard modes (and full checkpointing) reproduce the single-device reference
(fp32, CPU, 2 gloo processes). bf16 against the bf16 reference, and the memory census:
tests/test_census_fsdp.py."""

import pytest

from harness.testing.launches import shared_launch
from harness.testing.reference import assert_matches_reference, reference_run
from harness.testing.spawn import run_losses
from harness.testing.workloads import tiny_workload

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 5
WORKLOAD = tiny_workload(steps=STEPS, warmup_steps=0)


LAYOUTS = [
    {"reshard_after_forward": True},
    {"reshard_after_forward": False},
    {"reshard_after_forward": True, "activation_checkpointing": "full"},
    {"reshard_after_forward": False, "activation_checkpointing": "selective"},
]
RUNS = [
    {"workload": dict(WORKLOAD), "layout": {"engine": "fsdp", "dp": 2, "micro_batch_size": 2, **lay}} for lay in LAYOUTS
]
launched = shared_launch("torch", 2, run_losses, RUNS, STEPS, True)


def test_fsdp2_matches_single_device_reference(launched):
    layouts, results = LAYOUTS, launched
    ref_losses, ref_state = reference_run(WORKLOAD, STEPS, micro_batch_size=2)
    for lay, result in zip(layouts, results, strict=True):
        assert_matches_reference(result, ref_losses, ref_state, str(lay))
    assert results[0]["describe"]["mixed_precision"].startswith("no MixedPrecisionPolicy")
