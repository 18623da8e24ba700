"""The zero-bubble schedules (zero_bubble, zbv, dualpipev) in the spec: which engine runs which, and the
layouts refused in one line before launch."""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.spec import layout_label, model_chunks, parse_spec

FOUR = {"model_overrides": {"layers": 4}}
KEEP = {"reshard_after_forward": False}  # what engine fsdp's split backward needs (its facts)


def _spec(engine: str, layout: dict, workload: dict | None = None) -> dict:
    wl = {"model": "tiny", "seq_len": 16, "global_batch_size": 8, "device": "cpu", **FOUR, **(workload or {})}
    return {"workload": wl, "layout": {"engine": engine, **layout}}


RUNS = [
    ("own", {"pp": 2, "pipeline_schedule": "zbv"}, {}),
    ("own", {"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2}, {"global_batch_size": 6}),
    ("own", {"pp": 2, "pipeline_schedule": "dualpipev"}, {"global_batch_size": 4}),
    ("own", {"pp": 2, "dp": 2, "pipeline_schedule": "zbv"}, {"global_batch_size": 2}),  # any m: 1 here
    ("fsdp", {"pp": 2, "pipeline_schedule": "zbv", **KEEP}, {"global_batch_size": 1}),
    ("fsdp", {"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2, **KEEP}, {"global_batch_size": 3}),
    ("fsdp", {"pp": 2, "pipeline_schedule": "dualpipev", **KEEP}, {"global_batch_size": 4}),
]


@pytest.mark.parametrize("engine,layout,workload", RUNS)
def test_the_engines_that_run_them_take_them(engine, layout, workload):
    parse_spec(_spec(engine, layout, workload))


REFUSED = [
    ("own", {"pp": 2, "pipeline_schedule": "dualpipev"}, {"global_batch_size": 3}, "layout.pipeline_schedule"),
    ("megatron", {"pp": 2, "pipeline_schedule": "zbv"}, {}, "layout.pipeline_schedule"),
    ("deepspeed", {"pp": 2, "pipeline_schedule": "zbv"}, {}, "layout.pipeline_schedule"),
    ("deepspeed", {"pp": 2, "pipeline_schedule": "dualpipev"}, {}, "layout.pipeline_schedule"),
    # spec-wide: a V or zero-bubble schedule without a pipeline, virtual stages on a V, zero_bubble with one chunk
    ("fsdp", {"pipeline_schedule": "zbv"}, {}, "layout.pipeline_schedule"),
    ("fsdp", {"pp": 2, "pipeline_schedule": "zbv", "virtual_stages": 2}, {}, "layout.virtual_stages"),
    ("fsdp", {"pp": 2, "pipeline_schedule": "zero_bubble"}, {}, "layout.virtual_stages"),
    # a V of two chunks per rank needs 2 pp stages of layers: the tiny model has 2
    ("own", {"pp": 2, "pipeline_schedule": "zbv"}, {"model_overrides": {"layers": 2}}, "layout.pp"),
    # torch's micro-batch counts (fsdp facts, batch_limits)
    ("fsdp", {"pp": 2, "pipeline_schedule": "dualpipev", **KEEP}, {"global_batch_size": 3}, "layout.pipeline_schedule"),
    (
        "fsdp",
        {"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2, **KEEP},
        {"global_batch_size": 5},
        "layout.pipeline_schedule",
    ),
    # FSDP2 resharding the blocks after forward loses the deferred weight gradients
    ("fsdp", {"pp": 2, "pipeline_schedule": "zbv"}, {}, "layout.reshard_after_forward"),
    # tied embeddings: the V puts the embedding and the head on rank 0, but in two chunks
    ("own", {"pp": 2, "pipeline_schedule": "zbv"}, {"model_overrides": {"layers": 4, "tie_embeddings": True}}, None),
]


@pytest.mark.parametrize("engine,layout,workload,field", REFUSED)
def test_refused_in_one_line_before_launch(engine, layout, workload, field):
    with pytest.raises(SpecError) as e:
        parse_spec(_spec(engine, layout, workload))
    assert "\n" not in str(e.value)
    if field is not None:
        assert e.value.field == field, str(e.value)


def test_messages_name_the_limit():
    with pytest.raises(SpecError) as e:
        parse_spec(_spec("fsdp", {"pp": 2, "pipeline_schedule": "dualpipev", **KEEP}, {"global_batch_size": 3}))
    assert "dualpipev needs at least 2 x pp = 4 micro-batches, got 3" in e.value.reason
    with pytest.raises(SpecError) as e:  # torch's rounds, the order both engines run
        parse_spec(
            _spec("own", {"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2}, {"global_batch_size": 5})
        )
    assert "rounds of max(1, m // pp) = 2: m=5 does not divide" in e.value.reason


def test_chunks_per_rank_and_labels():
    assert [model_chunks(s, 3) for s in ("1f1b", "gpipe", "interleaved", "zero_bubble", "zbv", "dualpipev")] == [
        1,
        1,
        3,
        3,
        2,
        2,
    ]
    zbv = parse_spec(_spec("own", {"pp": 2, "pipeline_schedule": "zbv"})).layout
    assert layout_label(zbv).endswith("zbv")
    zb = parse_spec(_spec("fsdp", {"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2, **KEEP})).layout
    assert layout_label(zb).endswith("zero_bubble v2")


def test_a_run_s_summary_names_the_schedule_only_with_a_pipeline():
    from harness.report.summary import summary_lines

    def line(layout):
        lay = {"engine": "own", "tp": 1, "dp": 1, "micro_batch_size": 1, "activation_checkpointing": "none"}
        lay |= {"attention": "sdpa", "rmsnorm": "torch", "pipeline_schedule": "1f1b", "virtual_stages": 1, **layout}
        w = {"model": "tiny", "seq_len": 16, "global_batch_size": 8, "precision": "fp32"}
        rec = {"run_id": "r", "status": "ok", "spec": {"workload": w, "layout": lay}}
        return summary_lines(rec, "s")[2]

    assert "pp 2 zbv dp 1" in line({"pp": 2, "pipeline_schedule": "zbv"})
    assert "pp 2 zero_bubble v2 dp 1" in line({"pp": 2, "pipeline_schedule": "zero_bubble", "virtual_stages": 2})
    assert "pp 1 dp 1" in line({"pp": 1})
