"""The planner's step time of many layouts at once (timing_batch.step_times, numpy arrays) is the scalar
model's (timing.step_time, one layout at a time), float for float and key for key in the breakdown's order,
for every candidate of the plans of tests/test_memory_batch.py (each engine, pipeline schedule, cp, MoE
with ep, fp8, FSDP2 with hybrid sharding, a fp32 workload)."""

from __future__ import annotations

import pytest
from test_memory_batch import CASES, plan_layouts

from harness.planner import timing
from harness.planner.hardware import load_profile
from harness.planner.predict import _memory
from harness.planner.timing_batch import step_times


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_candidates_step_time_is_the_scalar_models(case):
    shape, wl, lays = plan_layouts(*case)
    prof = load_profile(case[4])
    theta = timing.theta_from_profile(prof)
    memory = [_memory(shape, lay, wl, prof)[1] for lay in lays]
    seconds, breakdowns = step_times(shape, lays, wl, prof, theta, {}, memory)
    cache: dict = {}
    for lay, got, got_breakdown, peak in zip(lays, seconds, breakdowns, memory, strict=True):
        want, want_breakdown = timing.step_time(shape, lay, wl, prof, theta, cache, memory_bytes=peak)
        assert got == want, lay
        assert list(got_breakdown.items()) == list(want_breakdown.items()), lay
        assert [type(v) for v in got_breakdown.values()] == [type(v) for v in want_breakdown.values()]


def test_a_change_to_step_time_not_made_in_the_arrays_is_caught(monkeypatch):
    """step_time's arithmetic changed but not timing_batch's raises Diverged (this file's tests fail), and
    predict_many predicts with step_time meanwhile."""
    from harness.planner import timing_batch
    from harness.planner.predict import predict, predict_many

    shape, wl, lays = plan_layouts(*CASES[0])
    prof = load_profile(CASES[0][4])
    breakdown = timing._breakdown

    def changed(*args):
        return {**breakdown(*args), "optimizer_s": 0.0}

    monkeypatch.setattr(timing, "_breakdown", changed)
    with pytest.raises(timing_batch.Diverged):
        step_times(shape, lays, wl, prof, timing.theta_from_profile(prof), {}, [0.0] * len(lays))
    many = predict_many(shape, lays[:40], wl, prof)
    assert many == [predict(shape, lay, wl, prof) for lay in lays[:40]]
    assert all(p.time_breakdown_s["optimizer_s"] == 0.0 for p in many)


def test_a_plan_mixing_balanced_and_unbalanced_routing_predicts_each_as_one_call():
    """moe_balanced changes a MoE layer's time (feedforward.busiest under ep > 1): layouts differing in it only
    do not share the layer cache's entry."""
    import dataclasses

    from harness.planner.predict import predict, predict_many

    shape, wl, lays = plan_layouts(*CASES[9])  # qwen3-30b-a3b, own
    prof = load_profile(CASES[9][4])
    some = [lay for lay in lays if lay.ep > 1][:60]
    mixed = [x for lay in some for x in (lay, dataclasses.replace(lay, moe_balanced=True))]
    assert predict_many(shape, mixed, wl, prof) == [predict(shape, lay, wl, prof) for lay in mixed]
