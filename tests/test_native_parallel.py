"""engine fsdp beyond data parallelism: DTensor TP/SP, torch.distributed.pipelining and their
3-D combination with FSDP2 reproduce the single-device reference (fp32, CPU, gloo), and the
layouts it cannot run are refused as spec errors.

One launch per world size runs all of that world's cases in sequence. The optimizer is AdamW with
lr 1 and eps 1 (as the own engine's equivalence tests): at eps 1e-8 Adam's first steps move every
weight by about lr x sign(gradient), so rounding-level differences in near-zero gradients (a
different summation order across tp shards) would show up as whole-step weight differences.
"""

import pytest

from harness.errors import SpecError
from harness.spec import parse_spec
from harness.testing.launches import shared_launch
from harness.testing.reference import assert_matches_reference, reference_run
from harness.testing.spawn import run_losses
from harness.testing.workloads import tiny_workload

STEPS = 3
WORKLOAD = tiny_workload(seq_len=16, steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0})
FOUR_LAYERS = {"model_overrides": {"layers": 4}}
KEEP = {"reshard_after_forward": False}


def _run(layout: dict, workload: dict | None = None) -> dict:
    return {"workload": {**WORKLOAD, **(workload or {})}, "layout": {"engine": "fsdp", "micro_batch_size": 2, **layout}}


def _check(runs: list[dict], results: list[dict], steps: int = STEPS) -> None:
    references: dict[str, tuple] = {}
    for run, result in zip(runs, results, strict=True):
        key = repr(sorted(run["workload"].items()))
        if key not in references:
            references[key] = reference_run(run["workload"], steps, micro_batch_size=2)
        assert_matches_reference(result, *references[key], str(run["layout"]))


TWO = [
    _run({"tp": 2}),
    _run({"tp": 2, "sequence_parallel": True}),
    _run({"pp": 2, "pipeline_schedule": "gpipe"}),
    _run({"pp": 2, "pipeline_schedule": "1f1b"}),
    _run({"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2}, FOUR_LAYERS),
    # the zero-bubble schedules (4 micro-batches: ScheduleDualPipeV's least at pp 2), which need the
    # blocks kept gathered (fsdp facts)
    _run({"pp": 2, "pipeline_schedule": "zbv", **KEEP}, FOUR_LAYERS),
    _run({"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2, **KEEP}, FOUR_LAYERS),
    _run({"pp": 2, "pipeline_schedule": "dualpipev", **KEEP}, FOUR_LAYERS),
]
FOUR = [_run({"dp": 2, "tp": 2}), _run({"pp": 2, "dp": 2})]
EIGHT_STEPS = 2  # 8 processes on a small CPU machine: the one 3-D case, few steps
EIGHT = [_run({"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True})]
two = shared_launch("torch", 2, run_losses, TWO, STEPS, True)
four = shared_launch("torch", 4, run_losses, FOUR, STEPS, True)
eight = shared_launch("torch", 8, run_losses, EIGHT, EIGHT_STEPS, True)


@pytest.mark.slow
def test_tp_and_pp_on_two_processes(two):
    runs, results = TWO, two
    _check(runs, results)
    for i, name in ((5, "ScheduleZBVZeroBubble"), (6, "ScheduleInterleavedZeroBubble"), (7, "ScheduleDualPipeV")):
        assert results[i]["describe"]["pipeline"]["schedule"] == name
    # the V: rank 0 holds stages 0 and 3 (the embedding and the head), rank 1 stages 1 and 2
    assert [s["pp_rank"] for s in results[5]["describe"]["pipeline"]["stages"]] == [0, 1, 1, 0]
    tp, interleaved = results[1]["describe"], results[4]["describe"]
    assert tp["mesh"] == {"pp": 1, "dp": 1, "tp": 2, "order": "pp, dp, tp (tp innermost)"}
    assert "SequenceParallel" in tp["tensor_parallel"]["norms"]
    assert interleaved["pipeline"]["schedule"] == "ScheduleInterleaved1F1B"
    assert interleaved["pipeline"]["stages"] == [{"stage": s, "pp_rank": s % 2, "layers": [s, s + 1]} for s in range(4)]


@pytest.mark.slow
def test_dp_with_tp_and_with_pp_on_four_processes(four):
    _check(FOUR, four)


@pytest.mark.slow
def test_tp_pp_dp_on_eight_processes(eight):
    _check(EIGHT, eight, EIGHT_STEPS)


# ---------------------------------------------------------------- refused before anything runs

REFUSED = [
    ({"pp": 1, "pipeline_schedule": "interleaved", "virtual_stages": 2}, {}, "layout.virtual_stages", "needs pp > 1"),
    (
        {"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2},
        {},
        "layout.pp",
        "2 layers cannot fill 4 pipeline stages",
    ),
    (
        {"pp": 2, "pipeline_schedule": "interleaved"},
        {"global_batch_size": 6},
        "layout.pipeline_schedule",
        "divisible by pp=2",
    ),
    ({"tp": 2, "zero_stage": 1}, {}, "layout.zero_stage", "reshard_after_forward"),
    # the precision policy where FSDP2 cannot follow it (harness/frameworks/fsdp/facts.py, ENGINE.precision_limits)
    (
        {"dp": 2},
        {"precision": "bf16", "grad_accum_dtype": "bf16"},
        "workload.grad_accum_dtype",
        "bf16 accumulation with an fp32 reduction is not offered",
    ),
    (
        {"pp": 2},
        {"precision": "bf16", "grad_reduce_dtype": "bf16"},
        "workload.grad_reduce_dtype",
        "fp32 accumulation needs grad_reduce_dtype: fp32",
    ),
]


@pytest.mark.parametrize("layout,workload,field,reason", REFUSED, ids=[r[2] for r in REFUSED])
def test_refused_layouts_are_spec_errors(layout, workload, field, reason):
    with pytest.raises(SpecError) as e:
        parse_spec(_run(layout, workload))
    assert e.value.field == field and reason in e.value.reason


def test_one_f_one_b_with_fewer_micro_batches_than_stages_is_refused_before_launch():
    with pytest.raises(SpecError) as e:
        parse_spec(_run({"pp": 2, "pipeline_schedule": "1f1b"}, {"global_batch_size": 2}))
    assert e.value.field == "layout.pipeline_schedule" and "at least pp=2 micro-batches" in e.value.reason


def test_every_parallel_layout_parses_for_fsdp():
    for layout, workload in [
        ({"tp": 2, "sequence_parallel": True}, {}),
        ({"pp": 2, "pipeline_schedule": "gpipe"}, {}),
        ({"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2}, FOUR_LAYERS),
        ({"tp": 2, "pp": 2, "dp": 2, "activation_checkpointing": "full"}, {}),
        ({"pp": 2}, {"precision": "bf16", "grad_accum_dtype": "bf16", "grad_reduce_dtype": "bf16"}),
        ({"dp": 2}, {"precision": "bf16", "grad_reduce_dtype": "bf16"}),
    ]:
        parse_spec(_run(layout, workload))
