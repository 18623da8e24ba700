"""Single-process check of the engine at tp=pp=dp=1 against the reference."""

from __future__ import annotations

import torch

from harness.testing import equivalence as E
from harness.testing.reference import mismatches


def test_engine_without_parallelism_matches_reference_in_process():
    from harness.runtime import RunContext
    from harness.frameworks.own import build
    from harness.model.presets import resolve_shape

    case = {"layout": {"micro_batch_size": 2, "activation_checkpointing": "selective", "attention": "naive"}}
    spec = E.make_spec(case)
    shape = resolve_shape("tiny")
    eng = build(spec, shape, RunContext(0, 1, 0, torch.device("cpu"), None))
    losses = [eng.train_step(b) for b in E.batches(spec, shape, 5)]
    ref_losses, ref_state = E.reference(case)
    assert not mismatches({"losses": losses, "state": eng.full_state_dict()}, ref_losses, ref_state)
    d = eng.last_step_details()
    assert d["comm"] == {}  # nothing to talk to
    assert eng.describe()["stages"] == [{"stage": 0, "layers": [0, 2]}]
