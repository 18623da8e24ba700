"""Single-process check of the engine at tp=pp=dp=1 against the reference."""

from __future__ import annotations

import torch

from harness.testing import equivalence as E
from harness.testing.reference import mismatches


def test_engine_without_parallelism_matches_reference_in_process():
    from harness.engine.adapter import build
    from harness.model.presets import resolve_shape
    from harness.runtime import RunContext

    case = {"layout": {"micro_batch_size": 2, "activation_checkpointing": "selective", "attention": "naive"}}
    spec = E.make_spec(case)
    shape = resolve_shape("tiny")
    eng = build(spec, shape, RunContext(0, 1, 0, torch.device("cpu"), None))
    losses = [float(eng.train_step(b)) for b in E.batches(spec, shape, 5)]
    ref_losses, ref_state = E.reference(case)
    assert not mismatches({"losses": losses, "state": eng.full_state_dict()}, ref_losses, ref_state)
    d = eng.last_step_details()
    assert d["comm"] == {}  # nothing to talk to
    assert eng.describe()["stages"] == [{"stage": 0, "layers": [0, 2]}]


def test_engine_runs_the_bf16_policy_in_process():
    """Megatron-style bf16 at tp=pp=dp=1: bf16 parameters (views of one flat buffer), fp32 main
    gradients, fp32 masters and Adam states; the reference's policy sentence; its losses."""
    from harness.engine.adapter import build
    from harness.model.presets import param_count, resolve_shape
    from harness.model.training import precision_policy
    from harness.runtime import RunContext

    case = {"workload": {"precision": "bf16"}}
    spec = E.make_spec(case)
    shape = resolve_shape("tiny")
    eng = build(spec, shape, RunContext(0, 1, 0, torch.device("cpu"), None))
    assert {p.dtype for p in eng.params} == {torch.bfloat16}
    assert eng.describe()["precision_policy"] == precision_policy(spec.workload).describe()
    losses = [float(eng.train_step(b)) for b in E.batches(spec, shape, 2)]
    ref_losses, _ = E.reference(case, steps=2)
    assert not mismatches({"losses": losses}, ref_losses, None, rtol=1e-4)
    n = param_count(shape)  # one bucket, no padding at dp=1
    census = eng.memory_census()
    assert census["parameters"] == {"bf16": 2 * n}
    assert census["gradients"] == {"fp32": 4 * n}
    assert census["master_parameters"] == {"fp32": 4 * n}
    assert census["optimizer_states"] == {"fp32": 8 * n + 4 * len(eng.params)}  # + a step counter each
    assert eng.last_step_details()["comm"] == {}
