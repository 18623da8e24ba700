"""FSDP2: both reshard modes (and full checkpointing) reproduce the single-device reference
(fp32, CPU, 2 gloo processes); bf16 stays close to it."""

import pytest

from harness.testing.reference import assert_matches_reference, reference_run
from harness.testing.spawn import run_losses, spawn

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 5
WORKLOAD = {"model": "tiny", "seq_len": 32, "global_batch_size": 8, "steps": STEPS, "warmup_steps": 0,
            "device": "cpu", "precision": "fp32"}


def test_fsdp2_matches_single_device_reference():
    layouts = [{"reshard_after_forward": True}, {"reshard_after_forward": False},
               {"reshard_after_forward": True, "activation_checkpointing": "full"},
               {"reshard_after_forward": False, "activation_checkpointing": "selective"}]
    runs = [{"workload": dict(WORKLOAD), "layout": {"engine": "fsdp", "dp": 2, "micro_batch_size": 2, **lay}}
            for lay in layouts]
    bf16 = {"workload": {**WORKLOAD, "precision": "bf16"},
            "layout": {"engine": "fsdp", "dp": 2, "micro_batch_size": 2}}
    results = spawn(run_losses, 2, runs + [bf16], STEPS, True, timeout_s=300)
    ref_losses, ref_state = reference_run(WORKLOAD, STEPS, micro_batch_size=2)
    for lay, result in zip(layouts, results[:-1], strict=True):
        assert_matches_reference(result, ref_losses, ref_state, str(lay))
    # bf16: parameters computed in bf16 (the reference autocasts fp32 weights): close, not equal
    for a, b in zip(results[-1]["losses"], ref_losses, strict=True):
        assert abs(a - b) <= 5e-3 * abs(b)
    assert "bf16" in results[-1]["describe"]["precision_note"]
