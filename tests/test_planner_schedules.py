"""The planner's pipeline schedules: virtual stages and the zero-bubble schedules in the
candidates, the bubble and the in-flight activations each implies (harness/planner/schedules.py)."""

from __future__ import annotations

import pytest

from harness.model.presets import PRESETS
from harness.planner import schedules
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.predict import predict


def _pred(**kw):
    base = dict(tp=4, pp=8, dp=2, micro_batch_size=1, engine="megatron", attention="te_fused")
    lay = PlannerLayout(**{**base, **kw})
    return predict(PRESETS["llama2-70b"], lay, Workload(4096, 128), load_profile("h100-sxm"))


def test_interleaving_divides_the_bubble_by_the_chunks_and_sends_v_times(monkeypatch):
    one, five = _pred(), _pred(pipeline_schedule="interleaved", virtual_stages=5)
    # each chunk boundary is a send: 5 chunks per rank send 5 times per micro-batch
    assert schedules.sends_per_micro_batch("interleaved", 5, 8, 3) == 10
    assert schedules.sends_per_micro_batch("1f1b", 1, 8, 0) == 1
    assert (
        five.time_breakdown_s["per_microbatch_slowest_stage_s"] > one.time_breakdown_s["per_microbatch_slowest_stage_s"]
    )
    # with the sends of 1F1B, the stages cost the same, and the bubble is exactly 1F1B's / 5
    monkeypatch.setattr(schedules, "sends_per_micro_batch", lambda s, v, p, stage: (stage < p - 1) + (stage > 0))
    same = _pred(pipeline_schedule="interleaved", virtual_stages=5).time_breakdown_s
    assert same["per_microbatch_slowest_stage_s"] == one.time_breakdown_s["per_microbatch_slowest_stage_s"]
    assert same["bubble_s"] == pytest.approx(one.time_breakdown_s["bubble_s"] / 5, rel=1e-12)


def test_zero_bubble_schedules_order_their_bubbles_by_the_deferred_weight_gradient():
    g = 0.8  # GEMMs' share of a stage's time
    assert schedules.bubble_factor("zero_bubble", 2, 8, g) == pytest.approx((1 - 2 * g / 3) / 2)
    # torch's ZBV order (the simulator's, tests/test_schedule_zbv.py): 2/3 (1 - g) up to g = 2/3, then 1/3 - g/6
    assert schedules.bubble_factor("zbv", 1, 8, g) == pytest.approx(1 / 3 - g / 6)
    assert schedules.bubble_factor("zbv", 1, 8, 0.5) == pytest.approx(1 / 3)
    assert schedules.bubble_factor("zbv", 1, 8, 1.0) == pytest.approx(1 / 6)  # not the ZB-V paper's zero
    assert schedules.bubble_factor("zbv", 1, 8, g) < schedules.bubble_factor("interleaved", 2, 8, g) == 1 / 2
    assert 0 < schedules.bubble_factor("dualpipev", 1, 8, g) < 1
    bubbles = {s: _pred(pipeline_schedule=s, virtual_stages=2).time_breakdown_s["bubble_s"] for s in ("zbv", "1f1b")}
    assert 0 <= bubbles["zbv"] < bubbles["1f1b"] / 2


def test_in_flight_activations_by_schedule():
    # Megatron's interleaved warm-up: 2 (p - s - 1) + (v - 1) p + 1 chunks of 1/v of the stage
    assert schedules.in_flight("interleaved", 5, 8, 0, 64) == pytest.approx((14 + 32 + 1) / 5)
    assert schedules.in_flight("1f1b", 1, 8, 3, 64) == 5
    assert schedules.in_flight("zbv", 1, 8, 7, 64) == 8  # every rank of a V as 1F1B's first
    assert schedules.in_flight("dualpipev", 1, 8, 7, 64) == 9  # DualPipe's table: PP + 1


def test_v_schedules_put_the_embedding_and_the_head_on_the_first_rank():
    from harness.planner.memory_engines import engine_stage_items

    lay = PlannerLayout(tp=1, pp=2, dp=1, micro_batch_size=1, engine="own", pipeline_schedule="zbv")
    items = engine_stage_items(PRESETS["tiny-4l"], lay, 128)
    assert items[0][0] and items[0][2] and not items[1][0] and not items[1][2]
    assert sum(layers for _, layers, _ in items) == 4


def test_candidates_range_over_virtual_stages_that_split_the_layers_evenly_for_megatron():
    from harness.planner import candidates

    opts = dict(
        attention=["te_fused"],
        rmsnorm=["fused"],
        micro_batch_sizes=[1],
        checkpointing=["none"],
        sequence_parallel=[True],
        zero_stage=1,
        engine="megatron",
    )
    lays = list(candidates.layouts(PRESETS["llama2-70b"], Workload(4096, 128), 64, 8, **opts))
    pairs = {(lay.pp, lay.pipeline_schedule, lay.virtual_stages) for lay in lays if lay.pp == 8}
    assert pairs == {(8, "1f1b", 1), (8, "interleaved", 2), (8, "interleaved", 5), (8, "interleaved", 10)}
    asked = candidates.layouts(
        PRESETS["llama2-70b"], Workload(4096, 128), 64, 8, pipeline_schedules=["zbv"], virtual_stages=[3], **opts
    )
    assert {lay.pipeline_schedule for lay in asked if lay.pp > 1} == {"zbv"}
    # the study's engine ran 1F1B only
    paper = candidates.layouts(PRESETS["paper-13b"], Workload(2048, 256), 16, 8, **{**opts, "engine": "paper"})
    assert {lay.pipeline_schedule for lay in paper} == {"1f1b"}


def test_plan_json_names_the_schedule_and_virtual_stages(capsys):
    import json

    from harness.cli import main

    args = (
        "plan --model llama2-70b --seq-len 4096 --global-batch-size 128 --gpus 64 --hardware h100-sxm "
        "--engine megatron --attention te_fused --rmsnorm fused --micro-batch-sizes 1 --activation-checkpointing none "
        "--virtual-stages 5 --format json"
    ).split()
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["pipeline_schedule"], r["virtual_stages"]) for r in rows if r["pp"] == 8} == {
        ("1f1b", 1),
        ("interleaved", 5),
    }
    assert all(r["pipeline_schedule"] is None and r["virtual_stages"] == 1 for r in rows if r["pp"] == 1)
    assert main([*args[:-2], "--pipeline-schedule", "zbv,sometimes"]) == 2
    assert "--pipeline-schedule" in capsys.readouterr().err
