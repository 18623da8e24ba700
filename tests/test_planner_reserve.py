"""The planner's caching-allocator reserve (harness/planner/memory_reserve.py) against the allocator's replay of traced
steps (harness/memtrace/allocator.py over `harness memory`'s fake-tensor trace, no processes): each block the model
names is the block the replay leaves free at its reserved peak, of the size the planner computes (with and without
expandable segments, under which the merged outputs take no segment of their own), and with it the
planner's peak (less the CUDA context, which no trace holds) meets the replayed reserved peak within the memory
target (10%), where without it it does not. A tiny model with a 32,768-token vocabulary, so that the loss's blocks
are the large-pool blocks of a real vocabulary; torchtitan's train step as benchmarks/torchtitan_reserved.py runs it
(`del pred` before the loss's backward; the pipeline's step(return_outputs=True))."""

from __future__ import annotations

import dataclasses

import pytest
import torch.nn.functional as F

from harness.memtrace.allocator import replay
from harness.planner import memory_reserve
from harness.planner.memory import GIB, stage_memory
from harness.planner.memory_terms import CONTEXT_GIB

MIB = 1 << 20


def _spec(layout: dict, batch: int):
    from harness.spec import parse_spec
    from harness.testing.workloads import tiny_workload

    raw = {**tiny_workload(model="tiny", seq_len=256, steps=2, warmup_steps=0), "global_batch_size": batch}
    return parse_spec({"workload": {**raw, "precision": "bf16"}, "layout": {"engine": "fsdp", **layout}})


def _traced(monkeypatch, spec, rank: int):
    """(the trace, its events, what it held at the step's start) of `rank`, the model's vocabulary 32,768."""
    import harness.memtrace.step as step
    from harness.memtrace.trace import trace_rank

    seen = {}
    plain = step.reserved_bytes

    def keep(events, held):
        seen["events"], seen["held"] = list(events), dict(held)
        return plain(events, held)

    monkeypatch.setattr(step, "reserved_bytes", keep)
    shape = dataclasses.replace(spec.shape(), vocab=32768)
    tr = trace_rank(spec, shape, rank, full_micro=True)
    return shape, tr, seen["events"], seen["held"]


def _planner(shape, spec, stage: int, **fields) -> tuple[dict, tuple]:
    """The planner's stage breakdown of the spec's layout (with `fields`), and (layout, workload)."""
    from harness.memtrace.terms import planner_layout

    lay, wl = planner_layout(spec)
    lay = dataclasses.replace(lay, **fields)
    return stage_memory(shape, lay, wl, stage), (lay, wl)


def _without_context(parts: dict) -> float:
    return parts["total"] - CONTEXT_GIB * GIB


def test_the_logits_freed_before_the_loss_backward_stay_reserved(monkeypatch):
    import harness.frameworks.fsdp.engine as fsdp_engine

    def torchtitan_loss(pred, labels):  # its loss_fn, then `del pred`: the logits' storage freed before backward
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        pred.untyped_storage().resize_(0)
        return loss

    monkeypatch.setattr(fsdp_engine, "lm_loss", torchtitan_loss)
    spec = _spec({"dp": 2, "micro_batch_size": 2}, 4)
    shape, tr, events, held = _traced(monkeypatch, spec, 0)
    alloc = replay(events, held)
    parts, (lay, wl) = _planner(shape, spec, 0)
    block = memory_reserve.logits_block(shape, lay, wl, True, 1)
    assert block == 512 * 32768 * 2 == parts["allocator_reserve"]  # the loss candidate is the stage's peak
    assert block in alloc.free_at_peak  # free at the replay's peak, no later request fitting it
    assert alloc.peak_reserved >= alloc.peak_allocated + block
    assert block in replay(events, held, expandable=True).free_at_peak  # inside the one segment: stranded too
    assert _planner(shape, spec, 0, expandable_segments=True)[0]["allocator_reserve"] == block
    planner, without = _without_context(parts), _without_context(parts) - block
    assert abs(planner / alloc.peak_reserved - 1) <= 0.10 < abs(without / alloc.peak_reserved - 1)


def test_the_pipelines_merged_outputs_take_a_new_segment(monkeypatch):
    import torch.distributed.pipelining.schedules as schedules

    from harness.memtrace.trace import stage_ranks

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        plain = cls.step

        def returning(self, *args, _plain=plain, **kwargs):  # torch's default, torchtitan's until 2025-10
            return _plain(self, *args, **{**kwargs, "return_outputs": True})

        monkeypatch.setattr(cls, "step", returning)
    spec = _spec({"pp": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}, 8)
    shape, tr, events, held = _traced(monkeypatch, spec, stage_ranks(spec.layout)[1])
    parts, _ = _planner(shape, spec, 1, pp_outputs_kept=True)
    merged = 4 * 512 * 32768 * 2  # m = 4 micro-batches of n = 512 tokens, bf16 logits
    assert parts["allocator_reserve"] == merged
    alloc = replay(events, held)
    assert max(alloc.free_at_peak) < merged  # no cached block holds the merge
    at = [i for i, (sign, _, n) in enumerate(events) if sign > 0 and n == merged]
    assert len(at) == 1
    key = events[at[0]][1]
    unmerged = replay([e for e in events if e[1] != key], held)
    assert alloc.peak_reserved - unmerged.peak_reserved == merged  # the merge's own segment, above the high-water
    planner, without = _without_context(parts), _without_context(parts) - merged
    assert abs(planner / alloc.peak_reserved - 1) <= 0.10 < abs(without / alloc.peak_reserved - 1)
    # expandable segments: the step's end leaves the segment's tail free, the merge grows into it
    grown = replay(events, held, expandable=True)
    assert grown.peak_reserved == replay([e for e in events if e[1] != key], held, expandable=True).peak_reserved
    assert "allocator_reserve" not in _planner(shape, spec, 1, pp_outputs_kept=True, expandable_segments=True)[0]


@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_fp32_logits_strand_nothing_and_a_pipeline_frees_none_before_its_loss(dtype_bytes):
    from harness.model.presets import PRESETS
    from harness.planner.layout import PlannerLayout, Workload

    shape, wl = PRESETS["llama3-8b"], Workload(8192, 16, dtype_bytes)
    lay = PlannerLayout(tp=1, pp=1, dp=8, micro_batch_size=2, engine="fsdp")
    want = 2 * 8192 * shape.vocab * 2 if dtype_bytes == 2 else 0.0
    assert memory_reserve.logits_block(shape, lay, wl, True, 1) == want
    assert memory_reserve.logits_block(shape, dataclasses.replace(lay, pp=2), wl, True, 1) == 0.0
    assert memory_reserve.logits_block(shape, dataclasses.replace(lay, engine="own"), wl, True, 1) == 0.0
