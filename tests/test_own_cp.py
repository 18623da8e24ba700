"""The own engine under context parallelism against the single-device reference.

Slow tier: one 2-rank and one 4-rank gloo launch run every case (tiny LLaMA, its 4 heads over 2
KV heads cover grouped-query attention; seq 32, 3 steps, fp32 at 1e-5 on every loss and final
weight, bf16 at the bf16 tolerances of tests/test_engine_equivalence.py), and every rank's counted
communication must equal the closed form (comm_model.rank_comm). Ring and allgather run attention
naive (their blocks are then naive's fp32 math) unless a case says sdpa or sdpa_flash (torch's CPU
flash op per block, harness/engine/lse_attention.py), and the reference runs the same kernel on
the whole sequence; ulysses runs the layout's kernel (sdpa) on its head shard.

Quick tier (no processes): the refusals' one line (a kernel the blocks do not compute; one the CPU
has no op for, before launch), the data slicing that keeps each target with its token, what a cp engine's build says
about itself (mesh, replica group, ZeRO-1 padding), and the profiler's name for the gradient group.
The whole file takes 18 s on this 2-core machine at load 4 (one 2-rank and one 4-rank launch).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_case_matches_reference

from harness.engine.comm_model import rank_comm
from harness.errors import SpecError
from harness.model.presets import resolve_shape
from harness.spec import layout_label, parse_spec
from harness.testing import equivalence as E

STEPS = 3
SHORT = {"seq_len": 32, "global_batch_size": 4}


def _case(workload: dict | None = None, **layout) -> dict:
    attention = "sdpa" if layout.get("cp_impl") == "ulysses" else "naive"
    return {"layout": {"attention": attention, **layout}, "workload": {**SHORT, **(workload or {})}}


BF16 = {"precision": "bf16"}
CASES = {
    2: [
        _case(cp=2, cp_impl="ring"),
        _case(cp=2, cp_impl="allgather"),
        _case(cp=2, cp_impl="ulysses"),
        _case(cp=2, cp_impl="ring", attention="sdpa"),  # sdpa blocks: torch's CPU flash kernel
        _case(cp=2, cp_impl="allgather", attention="sdpa"),
        _case(cp=2, cp_impl="ring", attention="sdpa_flash"),  # the same op, named: accepted on CPU
        _case(cp=2, cp_impl="allgather", attention="sdpa_flash"),
        _case(cp=2, cp_impl="ring", activation_checkpointing="full"),
        _case(cp=2, cp_impl="ring", activation_checkpointing="selective", micro_batch_size=2),
        _case(cp=2, cp_impl="ulysses", activation_checkpointing="selective"),
        {**_case(BF16, cp=2, cp_impl="ring"), "rtol": E.BF16_LOSS_RTOL, "weights_rtol": E.BF16_WEIGHTS_RTOL},
    ],
    4: [
        _case(cp=2, tp=2, sequence_parallel=True, cp_impl="ring"),
        _case(cp=2, pp=2, cp_impl="ring"),
        _case(cp=2, dp=2, zero_stage=1, dp_bucket_mb=0.05, cp_impl="ring"),
        _case(cp=4, cp_impl="ring"),
        _case({"model_overrides": {"kv_heads": 4}}, cp=2, tp=2, cp_impl="ulysses"),  # heads / (cp x tp) = 1
    ],
}


def _id(world: int, index: int, case: dict) -> str:
    lay, precision = case["layout"], case["workload"].get("precision", "fp32")
    extras = [
        lay["attention"],
        lay.get("activation_checkpointing", ""),
        f"mb{lay.get('micro_batch_size', 1)}",
        precision,
    ]
    words = layout_label({"engine": "own", **lay}, short=True).split()[1:] + [e for e in extras if e]
    return f"w{world}-{index}-" + "-".join(words)


PARAMS = [
    pytest.param(world, i, id=_id(world, i, c), marks=pytest.mark.slow)
    for world, cases in CASES.items()
    for i, c in enumerate(cases)
]


launched = E.shared(CASES, steps=STEPS)  # a failed launch fails each of its cases, not by relaunching for each


@pytest.mark.parametrize("world,index", PARAMS)
def test_matches_single_device(launched, world, index):
    per_rank = launched(world)
    case = CASES[world][index]
    ref_losses, ref_state = E.reference(case, steps=STEPS)
    assert_case_matches_reference(per_rank, world, index, case, ref_losses, ref_state)


@pytest.mark.parametrize("world,index", PARAMS)
def test_comm_counts_match_the_closed_form(launched, world, index):
    per_rank = launched(world)
    spec = E.make_spec(CASES[world][index])
    w = spec.workload
    shape = resolve_shape(w.model, w.model_overrides)
    for r in range(world):
        expected = rank_comm(
            shape, spec.layout, w.seq_len, w.global_batch_size, r, w.precision, w.grad_accum_dtype, w.grad_reduce_dtype
        )
        assert per_rank[r][index]["comm"] == expected, f"rank {r}"
        assert per_rank[r][index]["comm_first"] == expected, f"rank {r} (first step)"


@pytest.mark.slow
def test_breakdown_charges_the_cp_waits_to_cp_comm(launched):
    """The cp axis's blocking time is its own component (taken out of compute), and the record's
    breakdown carries it as exposed cp communication."""
    from harness.profiling.record import from_instrumented

    for rank in launched(2):
        b = rank[0]["details"]["breakdown_s"]
        assert b["cp_comm"] >= 0 and b["compute"] > 0
        assert from_instrumented(b)["exposed_comm"]["cp"] == pytest.approx(1e3 * b["cp_comm"])


# ------------------------------------------------------------------ quick


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_blockwise_cp_refuses_a_kernel_it_does_not_compute(impl):
    raw = {
        "workload": {"model": "tiny", "device": "cpu", **SHORT},
        "layout": {"engine": "own", "cp": 2, "cp_impl": impl, "attention": "flash2"},
    }
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert e.value.field == "layout.attention" and "needs attention naive, sdpa, sdpa_flash" in e.value.reason
    raw["layout"]["cp_impl"] = "ulysses"  # runs the layout's kernel on its head shard
    assert parse_spec(raw).layout.cp == 2


@pytest.mark.parametrize("attention", ["sdpa_efficient", "sdpa_cudnn"])
def test_blockwise_cp_with_a_cuda_only_kernel_is_refused_on_the_cpu_before_launch(attention):
    """The spec takes them (CUDA has their ops); on this CPU the kernel check that compare, sweep and
    every rank's preflight make before anything is built refuses them in one line."""
    from harness.model.kernels import run_kernels

    spec = E.make_spec(_case(cp=2, cp_impl="ring", attention=attention))
    with pytest.raises(SpecError) as e:
        run_kernels(spec, torch.device("cpu"))
    assert e.value.field == "layout.attention" and e.value.reason.startswith(f"{attention} cannot run on cpu")
    assert len(str(e.value).splitlines()) == 1


def test_cp_micro_batches_keep_each_target_with_its_token():
    from harness.data.source import micro_batches
    from harness.model.llama import cp_token_index

    rows = torch.arange(2 * 17).reshape(2, 17)  # token id = its position (+ 17 on the second row)
    held = []
    for index in range(2):
        positions = cp_token_index(16, 2, index)
        ((inputs, targets),) = micro_batches(rows, 2, positions)
        assert inputs.tolist() == rows[:, positions].tolist() and (targets == inputs + 1).all()
        held += positions.tolist()
    assert sorted(held) == list(range(16))


def test_a_cp_build_reduces_over_dp_x_cp_and_says_so():
    """Built as rank 0 of cp2 x dp2 without processes: the gradients' axis is the replica group
    (dp x cp, 4 ranks), ZeRO-1 buckets are padded to a multiple of 4, activations are seq/cp long."""
    from harness.engine.engine import Engine3D
    from harness.runtime import RunContext

    spec = E.make_spec(_case(cp=2, dp=2, zero_stage=1, dp_bucket_mb=0.05, cp_impl="ring"))
    shape = resolve_shape(spec.workload.model, spec.workload.model_overrides)
    eng = Engine3D(spec, shape, RunContext(0, 4, 0, torch.device("cpu"), None))
    d = eng.describe()
    assert (d["cp"], d["cp_impl"], d["mesh"]["cp"], d["mesh"]["dp"]) == (2, "ring", 2, 2)
    assert eng.parallel.dp.ranks == eng.mesh.dims.flat_group_of(0) == [0, 1, 2, 3]
    assert eng.parallel.cp.ranks == [0, 1]
    assert all(b % 4 == 0 for b in d["dp_buckets"]) and len(d["dp_buckets"]) > 1
    assert eng.executor.act_shape == (16, 1, shape.hidden)
    assert eng.cos.shape[0] == 16


def test_the_profiler_names_the_gradient_group_dp_though_it_holds_the_cp_ranks():
    """At dp1 x cp2 the replica group and the cp group are the same two ranks; the Mesh names the
    former "dp" (group_desc), and the profiler's axis follows the name, not the ranks."""
    from types import SimpleNamespace

    from harness.parallel_dims import ParallelDims
    from harness.profiling.annotate import AxisOf

    dims = ParallelDims(cp=2)
    assert dims.axis_of_group(0, [0, 1]) == "cp"  # by ranks alone it would be cp
    assert AxisOf(dims, 0)(SimpleNamespace(group_desc="dp")) == "dp"
