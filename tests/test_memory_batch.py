"""The planner's memory of many layouts at once (memory_batch.memories, numpy arrays) is the scalar model's
(predict._memory: memory.worst_stage_memory, one layout at a time), float for float and key for key in
the breakdown's order, for every candidate of plans of each engine the arrays hold: pipelines of every
schedule, cp, MoE with ep, fp8, FSDP2 with hybrid sharding, DeepSpeed's ZeRO stages, a fp32 workload,
and the recipes' settings that keep the batched path (te_attention, loss_fusion, fused SwiGLU, fp8
parameters, ...). The layouts it does not hold (batched) are left to the scalar path."""

from __future__ import annotations

import dataclasses

import pytest

from harness.model.presets import PRESETS
from harness.planner import candidates, memory_batch
from harness.planner.hardware import load_profile
from harness.planner.layout import Workload
from harness.planner.predict import ALLOCATOR_MARGIN, _memory

CASES = [
    # (model, seq, batch, gpus, profile, engine, fields, precisions, schedules, dtype bytes)
    ("llama3-8b", 16384, 32, 8, "h100-sxm", "own", {}, ("bf16",), ["1f1b", "interleaved", "zbv"], 2),
    ("llama3-8b", 8192, 64, 16, "h100-sxm", "megatron", {}, ("bf16", "fp8"), None, 2),
    (
        "llama3-8b",
        8192,
        64,
        16,
        "b200",
        "megatron",
        {"te_attention": True, "loss_fusion": True, "fused_swiglu": True, "fp8_params": True, "fp8_transpose": False},
        ("fp8",),
        None,
        2,
    ),
    ("llama3-8b", 8192, 64, 16, "h200", "fsdp", {"fsdp": True}, ("bf16", "fp8"), ["1f1b", "zero_bubble"], 2),
    ("llama3-8b", 8192, 64, 32, "h200", "fsdp", {"fsdp": True, "vocab_parallel_loss": True}, ("bf16",), None, 2),
    # torchtitan's 2024-12 pipelines: the last stage's kept and merged outputs (memory_reserve's merged block)
    ("llama3-8b", 8192, 128, 16, "h100-sxm", "fsdp", {"fsdp": True, "pp_outputs_kept": True}, ("bf16",), ["1f1b"], 2),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "deepspeed", {}, ("bf16",), None, 2),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "deepspeed", {"zero_stage": 3}, ("bf16",), None, 2),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "deepspeed", {"zero_stage": 0}, ("bf16",), None, 2),
    ("paper-13b", 2048, 256, 16, "a100-80gb", "own", {"compile": "blocks"}, ("bf16",), ["gpipe", "dualpipev"], 4),
    ("qwen3-30b-a3b", 4096, 128, 16, "h100-sxm", "own", {}, ("bf16",), None, 2),
    ("qwen3-30b-a3b", 4096, 128, 16, "h100-sxm", "megatron", {"expert_tp": 1}, ("bf16", "fp8"), None, 2),
    ("mixtral-8x7b", 4096, 64, 16, "h100-sxm", "deepspeed", {}, ("bf16",), None, 2),
]


def plan_layouts(model, seq, batch, gpus, hw, engine, fields, precisions, schedules, dtype) -> tuple:
    """(shape, workload, every candidate) of a case."""
    shape, prof, wl = PRESETS[model], load_profile(hw), Workload(seq, batch, dtype)
    fields = dict(fields)
    zero = fields.pop("zero_stage", 1)
    lays = list(
        candidates.layouts(
            shape,
            wl,
            gpus,
            prof.gpus_per_node,
            attention=["flash2", "naive", "fused_softmax"],
            rmsnorm=["fused", "torch"],
            micro_batch_sizes=[1, 2],
            checkpointing=["none", "selective", "full"],
            sequence_parallel=[False, True],
            zero_stage=zero,
            precisions=precisions,
            pipeline_schedules=schedules,
            engine=engine,
            **fields,
        )
    )
    assert len(lays) > 100 and (len({lay.pp for lay in lays}) > 1 or engine == "deepspeed" and shape.moe)
    return shape, wl, lays


@pytest.mark.parametrize(
    "model, seq, batch, gpus, hw, engine, fields, precisions, schedules, dtype",
    CASES,
    ids=[f"{c[5]}-{c[0]}-{i}" for i, c in enumerate(CASES)],
)
def test_every_candidates_memory_is_the_scalar_models(
    model, seq, batch, gpus, hw, engine, fields, precisions, schedules, dtype
):
    shape, wl, lays = plan_layouts(model, seq, batch, gpus, hw, engine, fields, precisions, schedules, dtype)
    prof = load_profile(hw)
    left = [lay for lay in lays if not memory_batch.batched(shape, lay, wl)]  # fsdp's one-round interleaved only
    assert all(lay.fsdp and lay.pipeline_schedule == "interleaved" for lay in left) and len(left) < len(lays) / 4
    lays = [lay for lay in lays if memory_batch.batched(shape, lay, wl)]
    for lay, got in zip(lays, memory_batch.memories(shape, lays, wl, prof, ALLOCATOR_MARGIN), strict=True):
        want = _memory(shape, lay, wl, prof)
        assert got[:2] == want[:2] and got[3:] == want[3:], lay
        assert list(got[2].items()) == list(want[2].items()), lay  # every part, in the breakdown's order
        assert [type(v) for v in (*got, *got[2].values())] == [type(v) for v in (*want, *want[2].values())]


def test_the_recipes_it_does_not_hold_are_left_to_the_scalar_path():
    shape, wl = PRESETS["llama3-8b"], Workload(8192, 64)
    lay = next(
        candidates.layouts(
            shape,
            wl,
            8,
            8,
            attention=["flash2"],
            rmsnorm=["fused"],
            micro_batch_sizes=[1],
            checkpointing=["full"],
            sequence_parallel=[False],
            zero_stage=1,
            engine="megatron",
        )
    )
    assert memory_batch.batched(shape, lay, wl)
    for change in ({"recompute_layers": 2}, {"offload_layers": 2}, {"main_grads": "bf16"}, {"engine": "paper"}):
        assert not memory_batch.batched(shape, dataclasses.replace(lay, **change), wl), change
    per_op = dataclasses.replace(lay, activation_checkpointing="selective", selective_policy="per_op")
    assert not memory_batch.batched(shape, per_op, wl)
    assert not memory_batch.batched(shape, lay, Workload(8192, 64, optimizer="muon"))


def test_a_term_the_arrays_lack_is_caught_and_the_plan_takes_the_scalar_path(monkeypatch):
    """A term added to engine_stage_memory but not to memory_batch (another part, here) raises Diverged from the
    arrays (this file's tests fail), and predict_many predicts with the scalar model meanwhile."""
    from harness.planner import memory, memory_engines
    from harness.planner.predict import predict, predict_many

    shape, wl, lays = plan_layouts(*CASES[0])
    prof = load_profile(CASES[0][4])
    scalar = memory_engines.engine_stage_memory

    def with_a_new_term(*args):
        parts = dict(scalar(*args))
        parts["total"] += 2**30
        return {**parts, "new_term": 2.0**30, "total": parts.pop("total"), "params": parts.pop("params")}

    monkeypatch.setattr(memory_engines, "engine_stage_memory", with_a_new_term)
    monkeypatch.setattr(memory, "engine_stage_memory", with_a_new_term)
    with pytest.raises(memory_batch.Diverged):
        memory_batch.memories(shape, lays, wl, prof, ALLOCATOR_MARGIN)
    many = predict_many(shape, lays[:40], wl, prof)
    assert [p.memory_breakdown_gib for p in many] == [
        predict(shape, lay, wl, prof).memory_breakdown_gib for lay in lays[:40]
    ]
    assert all(p.memory_breakdown_gib["new_term"] == 1.0 for p in many)


def test_a_plan_mixing_layouts_the_arrays_hold_and_others_predicts_each_as_one_call():
    """predict_many over layouts the arrays hold and layouts they leave to the scalar path (per-layer
    recomputation, offload, bf16 main gradients, per-op checkpointing, Muon's workload elsewhere), mixed."""
    from harness.planner.predict import predict, predict_many

    shape, wl, lays = plan_layouts(*CASES[1])  # megatron
    prof = load_profile(CASES[1][4])
    full = [lay for lay in lays if lay.activation_checkpointing == "full"][:30]
    changes = ({"recompute_layers": 1}, {"offload_layers": 2}, {"main_grads": "bf16"})
    others = [dataclasses.replace(lay, **changes[i % 3]) for i, lay in enumerate(full)]
    others += [
        dataclasses.replace(lay, activation_checkpointing="selective", selective_policy="per_op") for lay in full
    ]
    mixed = [lay for pair in zip(lays[:120], others * 2, strict=False) for lay in pair]
    assert any(not memory_batch.batched(shape, lay, wl) for lay in mixed) and any(
        memory_batch.batched(shape, lay, wl) for lay in mixed
    )
    assert predict_many(shape, mixed, wl, prof) == [predict(shape, lay, wl, prof) for lay in mixed]
