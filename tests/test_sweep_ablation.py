"""The sweep report's recommendations compare like with like: an ablation pairs only runs that differ
in its one field, every other layout field equal (or says there are none), and every figure it and the
'Measured against quoted' section print carries its unit. Synthetic records, no processes."""

from __future__ import annotations

import json

from conftest import profiled_record

from harness.report.build import sections_for


def record(tokens_per_s: float, precision: str = "bf16", **layout) -> dict:
    """An ok run of the tiny model on 2 CPU processes at `tokens_per_s` per device."""
    lay = {
        "engine": "own",
        "tp": 1,
        "pp": 1,
        "dp": 2,
        "micro_batch_size": 1,
        "activation_checkpointing": "none",
        "attention": "sdpa",
        "rmsnorm": "torch",
        **layout,
    }
    spec = {"workload": {"model": "tiny", "seq_len": 64, "global_batch_size": 8, "precision": precision}, "layout": lay}
    step = 1e3 * 512 / tokens_per_s / 2  # ms
    parts = {"compute": step}
    return profiled_record(
        spec, step, parts, 2, tokens_per_s, sweep="s", point_key=json.dumps([lay, precision], sort_keys=True)
    )


def recommendations(records) -> dict:
    """{the statement's first words: the statement} and the section's plain text."""
    sec = {s.id: s for s in sections_for(records)}["recommendations"]
    return {t.caption.split(":")[0]: t for t in sec.tables}, " ".join(sec.text)


# own pp2 mb2 is the fastest run; DeepSpeed ran dp2 mb1 only
FASTEST_ELSEWHERE = [record(6000.0, pp=2, dp=1, micro_batch_size=2), record(3000.0, engine="deepspeed", zero_stage=1)]


def test_an_engine_is_not_compared_with_another_at_a_different_layout():
    tables, text = recommendations(FASTEST_ELSEWHERE)
    assert "engine" not in tables
    assert "engine: no two runs that finished differ in engine alone (every other layout field equal)" in text
    # own at DeepSpeed's layout, slower than DeepSpeed there: DeepSpeed wins the one like-for-like pair
    tables, _ = recommendations([*FASTEST_ELSEWHERE, record(2000.0)])
    engine = tables["engine"]
    assert engine.caption.startswith(
        "engine: deepspeed ZeRO-1 was best in 1 of 1 comparison(s) of runs that differ in engine alone "
        "(every other layout field equal; 1 sweep(s)), by 50.0% more tokens/s per device than the runner-up"
    )
    assert [(r[2], r[3], r[5]) for r in engine.rows] == [
        ("deepspeed ZeRO-1", "3,000 tokens/s per device", "deepspeed ZeRO-1 tp1 pp1 dp2 mb1 ckpt=none sdpa/torch"),
        ("own", "2,000 tokens/s per device", "own tp1 pp1 dp2 mb1 ckpt=none sdpa/torch"),
    ]


def test_a_micro_batch_size_is_not_compared_across_pipeline_schedules():
    gpipe_only = [
        record(5000.0, pp=2, dp=1, micro_batch_size=2, pipeline_schedule="1f1b"),
        record(3000.0, pp=2, dp=1, micro_batch_size=1, pipeline_schedule="gpipe"),
    ]
    tables, text = recommendations(gpipe_only)
    assert "micro-batch size" not in tables and "micro-batch size: no two runs that finished" in text
    tables, _ = recommendations(
        [*gpipe_only, record(4000.0, pp=2, dp=1, micro_batch_size=4, pipeline_schedule="gpipe")]
    )
    mb = tables["micro-batch size"]
    assert mb.caption.startswith("micro-batch size: 4 was best in 1 of 1 comparison(s)")
    assert {r[2] for r in mb.rows} == {"1", "4"} and all("gpipe" in r[5] for r in mb.rows)


def test_a_schedule_that_does_nothing_without_a_pipeline_does_not_split_a_comparison():
    tables, _ = recommendations([record(3000.0, pipeline_schedule="gpipe"), record(2000.0, micro_batch_size=2)])
    assert tables["micro-batch size"].caption.startswith("micro-batch size: 1 was best in 1 of 1 comparison(s)")


def test_tp_against_pp_compares_the_same_gpus_with_the_rest_equal():
    runs = [record(5000.0, pp=2, dp=1), record(4000.0, tp=2, dp=1, micro_batch_size=2)]
    tables, text = recommendations(runs)
    assert "pipeline vs tensor parallelism" not in tables
    assert "pipeline vs tensor parallelism: no pipeline-heavier and tensor-heavier runs" in text
    tables, _ = recommendations([*runs, record(4500.0, tp=2, dp=1, sequence_parallel=True)])
    split = tables["pipeline vs tensor parallelism"]
    assert split.caption.startswith("pipeline vs tensor parallelism: of 1 comparison(s)")
    assert "the pipeline-heavier was decidedly faster in 1, the tensor-heavier in 0, and 0 were not" in split.caption
    assert [r[3] for r in split.rows] == ["5,000 tokens/s per device", "4,500 tokens/s per device"]


def test_the_measured_best_figure_has_its_unit():
    quoted = {s.id: s for s in sections_for(FASTEST_ELSEWHERE)}["baselines"]
    measured = next(t for t in quoted.tables if t.caption == "Measured in this store")
    assert measured.rows[0][1] == "6,000 tokens/s per device"


def test_the_levers_are_compared_one_at_a_time():
    """FP8 (a workload field), torch.compile and the pipeline schedule each pair runs that differ in that
    field alone: an FP8 run that also compiles, or also gathers in FP8, has no bf16 twin."""
    runs = [
        record(2000.0),
        record(3000.0, precision="fp8"),
        record(2600.0, compile="blocks"),
        record(4000.0, precision="fp8", compile="blocks", micro_batch_size=2),
        record(2100.0, micro_batch_size=2),
        record(3500.0, precision="fp8", fp8_all_gather=True, micro_batch_size=2),
    ]
    tables, text = recommendations(runs)
    fp8, compiled = tables["precision (bf16 or fp8)"], tables["torch.compile"]
    assert fp8.caption.startswith("precision (bf16 or fp8): fp8 was best in 1 of 1 comparison(s)")
    assert fp8.caption.split(", by ")[1].startswith("50.0% more tokens/s per device")
    # bf16 mb1 eager against compiled; never fp8 compiled mb2 against bf16 eager mb2 (precision differs too)
    assert compiled.caption.startswith("torch.compile: blocks was best in 1 of 1 comparison(s)")
    assert compiled.caption.split(", by ")[1].startswith("30.0% more tokens/s per device")
    assert [r[3] for r in compiled.rows] == ["2,600 tokens/s per device", "2,000 tokens/s per device"]
    assert "pipeline schedule" not in " ".join(tables) and "pipeline schedule" not in text  # no pipeline ran


def test_pipeline_schedules_are_compared_where_there_is_a_pipeline():
    runs = [
        record(3000.0, pp=2, dp=1, micro_batch_size=2),
        record(3300.0, pp=2, dp=1, micro_batch_size=2, pipeline_schedule="zbv"),
        record(9000.0, micro_batch_size=2),  # no pipeline: outside the comparison
    ]
    tables, _ = recommendations(runs)
    sched = tables["pipeline schedule (pp > 1 only)"]
    assert sched.caption.startswith("pipeline schedule (pp > 1 only): zbv was best in 1 of 1 comparison(s)")
    assert {r[2] for r in sched.rows} == {"1f1b", "zbv"}
    sections = {s.id: s for s in sections_for(runs)}
    assert [row[0] for row in sections["schedules"].tables[0].rows] == ["1f1b", "zbv"]
    assert "No sweep varied compile" in " ".join(sections["compile"].text)
