"""`harness plan` and `harness memory` use every option asked for or refuse it in one line (exit 2): an
expert-parallel degree no layout takes, virtual stages without a schedule that has them, a pipeline
schedule the engine's facts say it does not run, a fit judged on a device nobody named."""

from __future__ import annotations

import json

import pytest

from harness.cli import main as cli

# narrowed to one kernel per option: the checks are the point, not the plan's size
NARROW = ["--attention", "flash2", "--rmsnorm", "fused", "--micro-batch-sizes", "1"]
NARROW += ["--activation-checkpointing", "full"]
QWEN = ["plan", "--model", "qwen3-30b-a3b", "--seq-len", "4096", "--global-batch-size", "512", "--gpus", "64"]
QWEN += ["--hardware", "h100-sxm", *NARROW]
LLAMA = ["plan", "--model", "llama3-70b", "--seq-len", "4096", "--global-batch-size", "512", "--gpus", "64", *NARROW]


@pytest.mark.parametrize(
    "ep, words",
    [
        ("3", "3 does not divide the 128 experts of qwen3-30b-a3b"),
        (str(10**30), f"{10**30} does not divide the 128 experts"),
        ("128", "128 is the expert-parallel degree of no layout of 64 GPUs"),
        ("2,128", "128 is the expert-parallel degree of no layout of 64 GPUs"),
    ],
)
def test_an_expert_degree_no_layout_takes_is_refused(no_launch, one_line_error, ep, words):
    line = one_line_error(cli([*QWEN, "--ep", ep]))
    assert line.startswith("error: --ep: ") and words in line


def test_the_expert_degrees_asked_for_are_the_ones_planned(no_launch, capsys):
    assert cli([*QWEN, "--ep", "2,8", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["ep"] for r in rows} == {2, 8}


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--pipeline-schedule", "1f1b", "--virtual-stages", "2"], "--pipeline-schedule 1f1b has none"),
        (["--pipeline-schedule", "1f1b,zbv", "--virtual-stages", "2"], "--pipeline-schedule 1f1b,zbv has none"),
        (["--engine", "deepspeed", "--virtual-stages", "2"], "engine deepspeed's default schedules has none"),
        # 80 layers: pp x 3 divides them at no pp (Megatron-core splits the layers evenly)
        (["--engine", "megatron", "--virtual-stages", "3"], "3 is the chunks per rank of no interleaved layout"),
    ],
)
def test_virtual_stages_no_layout_takes_are_refused(no_launch, one_line_error, flags, words):
    line = one_line_error(cli([*LLAMA, *flags]))
    assert line.startswith("error: --virtual-stages: ") and words in line


def test_the_virtual_stages_asked_for_are_the_ones_planned(no_launch, capsys):
    assert cli([*LLAMA, "--pipeline-schedule", "interleaved", "--virtual-stages", "2,5", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["virtual_stages"] for r in rows if r["pp"] > 1} == {2, 5}


@pytest.mark.parametrize(
    "engine, schedule, words",
    [
        ("megatron", "zero_bubble", "Megatron-core's schedules are 1F1B and interleaved 1F1B"),
        ("megatron", "zbv", "Megatron-core's schedules are 1F1B and interleaved 1F1B"),
        ("megatron", "gpipe", "Megatron-core's schedules are 1F1B and interleaved 1F1B"),
        ("deepspeed", "zbv", "DeepSpeed's pipeline engine runs its 1F1B TrainSchedule only"),
        ("deepspeed", "interleaved", "DeepSpeed's pipeline engine runs its 1F1B TrainSchedule only"),
        ("paper", "zero_bubble", "the study's engine ran 1f1b only"),
    ],
)
def test_a_schedule_the_engine_does_not_run_is_refused(no_launch, one_line_error, engine, schedule, words):
    line = one_line_error(cli([*LLAMA, "--engine", engine, "--pipeline-schedule", f"1f1b,{schedule}"]))
    assert line.startswith("error: --pipeline-schedule: ") and words in line


def test_sequence_parallelism_the_engine_has_not_is_refused_and_not_planned(no_launch, one_line_error, capsys):
    """DeepSpeed has no Megatron-style sequence parallelism (its facts' why_not): asked for, refused; by
    default no candidate has it."""
    line = one_line_error(cli([*LLAMA, "--engine", "deepspeed", "--sequence-parallel", "on,off"]))
    assert line.startswith("error: --sequence-parallel: on: DeepSpeed has no Megatron-style sequence parallelism")
    assert cli([*LLAMA, "--engine", "deepspeed", "--format", "json"]) == 0
    assert {r["sequence_parallel"] for r in json.loads(capsys.readouterr().out)} == {False}
    assert cli([*LLAMA, "--engine", "own", "--format", "json"]) == 0
    assert {r["sequence_parallel"] for r in json.loads(capsys.readouterr().out)} == {False, True}


def test_the_schedules_an_engine_runs_are_planned(no_launch, capsys):
    """The engines' facts (one owner: harness/frameworks/*/facts.py, harness/engine/facts.py) decide."""
    from harness import registry

    for engine in ("megatron", "fsdp", "own"):
        runs = registry.facts(engine).runs("layout.pipeline_schedule", ["1f1b", "interleaved", "zero_bubble", "zbv"])
        assert cli([*LLAMA, "--engine", engine, "--pipeline-schedule", ",".join(runs), "--format", "json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert {r["pipeline_schedule"] for r in rows if r["pp"] > 1} == set(runs), engine


def _tiny_spec(tmp_path):
    spec = tmp_path / "t.yaml"
    spec.write_text(
        "workload: {model: tiny, seq_len: 32, global_batch_size: 4, precision: bf16}\n"
        "layout: {engine: own, tp: 2, pp: 1, dp: 1, zero_stage: 0}\n"
    )
    return str(spec)


def test_memory_judges_no_fit_without_a_named_device(no_launch, capsys):
    """A spec names no device (an imported plan's was the plan's --hardware): no fit on an assumed one."""
    from harness.commands.memory import NO_HARDWARE

    spec = _tiny_spec(no_launch)
    assert cli(["memory", spec]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(NO_HARDWARE) and "fits on" not in out and "a100" not in out
    assert cli(["memory", spec, "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["hardware"] is None and "fits" not in result
    assert cli(["memory", spec, "--hardware", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "fits on h100-sxm" in out and NO_HARDWARE not in out


def test_memory_refuses_an_unknown_device(no_launch, one_line_error):
    line = one_line_error(cli(["memory", _tiny_spec(no_launch), "--hardware", "h100-pcie-nope"]))
    assert line.startswith("error: --hardware")


# ---------------------------------------------------------------- headroom: the allocator's margin

TIGHT = ["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch-size", "64", "--gpus", "8", *NARROW]


def _device_of(tmp_path, memory_gib: float) -> str:
    """h100-sxm's profile with another device memory, as a profile file --hardware takes."""
    import dataclasses

    from harness.planner.hardware import load_profile, save_profile

    path = tmp_path / f"dev-{memory_gib:.3f}.yaml"
    save_profile(dataclasses.replace(load_profile("h100-sxm"), memory_gib=memory_gib), path)
    return str(path)


def test_a_fit_within_the_allocator_margin_is_marked(no_launch, capsys):
    """A layout predicted at 97% of the device fits, marked (yes!, a line naming the margin); at 90% it is
    not; the JSON rows carry the mark exactly where the total lies within the margin of the device."""
    from harness.planner.predict import ALLOCATOR_MARGIN

    assert cli([*TIGHT, "--hardware", "h100-sxm", "--format", "json"]) == 0
    first = next(r for r in json.loads(capsys.readouterr().out) if r["fits"])
    mem = first["memory_gib"]
    assert cli([*TIGHT, "--hardware", _device_of(no_launch, mem / 0.97), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    device = mem / 0.97
    edge = (1 - ALLOCATOR_MARGIN) * device
    for r in rows:  # (memory_gib is rounded to 0.01: rows at the edge itself are not judged)
        if r["fits"] and r["memory_gib"] > edge + 0.01:
            assert r["within_allocator_margin"], r
        elif not r["fits"] or r["memory_gib"] < edge - 0.01:
            assert not r["within_allocator_margin"], r
    assert any(r["within_allocator_margin"] and r["memory_gib"] == mem for r in rows)
    assert cli([*TIGHT, "--hardware", _device_of(no_launch, device), "--top", "50"]) == 0
    out = capsys.readouterr().out
    assert " yes! " in out
    margin = [ln for ln in out.splitlines() if ln.startswith("! ")]
    assert len(margin) == 1 and f"of {device:g}: within the {ALLOCATOR_MARGIN:.0%} allocator margin" in margin[0]
    assert "may not fit" in margin[0]
    assert cli([*TIGHT, "--hardware", _device_of(no_launch, mem / 0.90), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert " yes! " not in out and not any(ln.startswith("! ") for ln in out.splitlines())
