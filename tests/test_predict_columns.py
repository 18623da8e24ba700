"""`harness plan`'s columns (predict_columns: every candidate of a candidate_table.Table predicted over arrays,
ranked, a Prediction built when read) are predict_many's predictions of candidates.layouts, ranked as plan_of
ranked them (sorted by fit, then MFU): every candidate, every field, both breakdowns key for key in order, the
values' types too, on plans of every engine, with the layouts the memory arrays do not hold (the recipes'
per-layer recomputation, fsdp's one-round interleaved order) and when the arrays diverge from the scalar
models (the scalar paths then). benchmarks/plan_speed.py --check compares the three benchmark plans."""

from __future__ import annotations

import dataclasses

import pytest

from harness.errors import SpecError
from harness.model.presets import PRESETS
from harness.planner import candidates, memory_batch, timing_batch
from harness.planner.hardware import load_profile
from harness.planner.layout import Workload
from harness.planner.predict import predict_many
from harness.planner.predict_columns import groups, plan_predictions

CASES = [
    # (model, seq, batch, gpus, profile, engine, fields, precisions, schedules)
    ("llama3-8b", 16384, 32, 8, "h100-sxm", "own", {}, ("bf16",), ["1f1b", "interleaved", "zbv"]),
    ("llama3-8b", 8192, 64, 16, "h100-sxm", "megatron", {"recompute_layers": 1}, ("bf16", "fp8"), None),
    ("llama3-8b", 8192, 16, 16, "h200", "fsdp", {"fsdp": True}, ("bf16",), ["1f1b", "interleaved"]),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "deepspeed", {"zero_stage": 3}, ("bf16",), None),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "paper", {}, ("bf16",), None),
    ("qwen3-30b-a3b", 4096, 128, 8, "h100-sxm", "own", {}, ("bf16",), None),
    ("qwen3-30b-a3b", 4096, 128, 16, "h100-sxm", "megatron", {"expert_tp": 1}, ("bf16", "fp8"), None),
]


def _plan(model, seq, batch, gpus, hw, engine, fields, precisions, schedules):
    shape, prof, wl = PRESETS[model], load_profile(hw), Workload(seq, batch)
    fields = dict(fields)
    options = dict(
        attention=["flash2", "sdpa", "naive"] + (["flash3"] if hw == "a100-80gb" else []),  # flash3 as flash2 there
        rmsnorm=["fused", "torch"],
        micro_batch_sizes=[1, 2],
        checkpointing=["none", "selective", "full"],
        sequence_parallel=[False, True],
        zero_stage=fields.pop("zero_stage", 1),
        precisions=precisions,
        pipeline_schedules=schedules,
        engine=engine,
        **fields,
    )
    return shape, prof, wl, prof.gpus_per_node, options


def _same(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.layout == b.layout and repr(a.layout) == repr(b.layout)
        assert (
            list(a.layout.__dict__.items())[: len(dataclasses.fields(a.layout))]
            == list(b.layout.__dict__.items())[: len(dataclasses.fields(b.layout))]
        )
        assert dataclasses.asdict(a) == dataclasses.asdict(b), a.layout
        assert list(a.memory_breakdown_gib.items()) == list(b.memory_breakdown_gib.items()), a.layout
        assert list(a.time_breakdown_s.items()) == list(b.time_breakdown_s.items()), a.layout
        assert [type(v) for v in a.__dict__.values()] == [type(v) for v in b.__dict__.values()], a.layout


def _reference(shape, prof, wl, gpn, gpus, options) -> list:
    """predict_many of candidates.layouts, ranked as plan_of ranked them before the columns."""
    want = predict_many(shape, candidates.layouts(shape, wl, gpus, gpn, **options), wl, prof)
    want.sort(key=lambda p: (not (p.fits and p.available), -p.mfu))
    return want


@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-{c[0]}" for c in CASES])
def test_every_candidate_is_predict_manys_in_plan_ofs_ranking(case):
    shape, prof, wl, gpn, options = _plan(*case)
    gpus = case[3]
    table = candidates.candidate_table(shape, wl, gpus, gpn, **options)
    assert list(table) == list(candidates.layouts(shape, wl, gpus, gpn, **options)) and len(table) > 100
    ranked = plan_predictions(shape, table, wl, prof)
    _same(list(ranked), _reference(shape, prof, wl, gpn, gpus, options))
    assert ranked[3] is ranked[3]  # one Prediction per row (export compares them by identity)
    fitting = ranked[: ranked.plan.n_fitting]
    assert all(p.fits and p.available for p in fitting) and not any(
        p.fits and p.available for p in ranked[ranked.plan.n_fitting :]
    )
    assert ranked.column("cp").tolist() == [p.layout.cp for p in ranked]
    assert ranked.column("step_time_s").tolist() == [p.step_time_s for p in ranked]
    held = len(ranked) - len(ranked.plan._scalar)  # rows the memory arrays hold; the others the scalar path's
    if case[5] == "fsdp":  # the one-round interleaved layouts only
        assert ranked.plan._scalar and held > 0
    else:  # the study's engine and Megatron's per-layer recomputation: none
        assert held == (0 if case[5] == "paper" or "recompute_layers" in case[6] else len(ranked))


@pytest.mark.parametrize("where", ["memory", "time"])
def test_arrays_that_diverge_from_the_scalar_models_give_way_to_them(monkeypatch, where):
    case = CASES[3]
    shape, prof, wl, gpn, options = _plan(*case)
    want = _reference(shape, prof, wl, gpn, case[3], options)
    if where == "memory":

        def diverged(*args, **kwargs):
            raise memory_batch.Diverged("a term the arrays lack")

        monkeypatch.setattr(memory_batch, "_check", diverged)
    else:
        real = timing_batch.finish

        def off(c, *args):  # the arrays' step time one ulp off step_time's
            out = real(c, *args)
            out["total"] = out["total"] * (1 + 2**-50)
            return out

        monkeypatch.setattr(timing_batch, "finish", off)
    ranked = plan_predictions(shape, candidates.candidate_table(shape, wl, case[3], gpn, **options), wl, prof)
    assert (ranked.plan._scalar != {}) == (where == "memory") and hasattr(ranked.plan, "_timed") == (where == "time")
    _same(list(ranked), want)


def test_an_invalid_candidate_is_refused_as_predict_many_refuses_it():
    shape, prof, wl, gpn, options = _plan(*CASES[3])
    table = candidates.candidate_table(shape, wl, 16, gpn, **options)
    table.values["rms"][1] = "bogus"  # a norm no layout may have: the first row with it is refused
    with pytest.raises(SpecError) as got:
        plan_predictions(shape, table, wl, prof)
    with pytest.raises(SpecError) as want:
        predict_many(shape, list(table), wl, prof)
    assert str(got.value) == str(want.value)


def test_groups_number_the_distinct_rows_in_order_of_first_sight():
    import numpy as np

    of, first = groups(np.array([3, 1, 3, 2, 1]), np.array([0, 0, 0, -1, 0]))
    assert of.tolist() == [0, 1, 0, 2, 1] and first.tolist() == [0, 1, 3]


def test_the_plan_command_builds_a_prediction_only_for_the_rows_it_reads(capsys):
    from harness.cli import build_parser
    from harness.commands.plan import _table, plan_of
    from harness.model.presets import resolve_shape

    argv = "plan --model llama3-8b --seq-len 8192 --global-batch-size 128 --gpus 64 --hardware h100-sxm --top 5".split()
    args = build_parser(argv)[0].parse_args(argv)
    prof = load_profile(args.hardware)
    wl, gpn, preds = plan_of(args, resolve_shape(args.model), prof)
    assert _table(args, resolve_shape(args.model), prof, wl, gpn, preds) == 0
    assert f"{len(preds)} layouts, {preds.plan.n_fitting} predicted to fit" in capsys.readouterr().out
    assert len(preds) > 10_000 and 5 <= len(preds.plan._built) < 500  # the shown rows, their kernels, the near ones
