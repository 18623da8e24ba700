"""Engine deepspeed's mixture of experts (DeepSpeed's own deepspeed.moe.layer.MoE, dropless, top-2 without the
sampled second expert, the harness's router losses) against the single-device reference: one 2-rank launch.

tiny-moe (8 experts, top-2, renormalised), seq 16, 3 steps, fp32: 1e-5 on every loss and every final weight
(the suite's fp32 tolerance: the same sums in another order, ~1e-7 relative per step; routing is discrete,
and no top-k choice sits within rounding of a tie at seed 1234). Cases, ZeRO-1: dp2 ep2 (each rank four of
the eight experts, tokens exchanged by DeepSpeed's all-to-all); dp2 ep1; dp2 ep2 with nonzero load-balancing
and z-loss coefficients and two micro-batches a rank (the losses' gradient scale 1/gradient_accumulation_steps,
then DeepSpeed's mean over dp: the reference's 1/micro-batches; the coefficients move the step-3 loss well
beyond the tolerance, so a wrong scale or DeepSpeed's own top-1 l_aux in their place fails); the losses
under ZeRO-2 with deepspeed.checkpointing per block (the gate's second forward, in backward, not counted;
the aux gradient attached in the recomputed graph); bf16 dp2 ep2 (BF16_Optimizer with MoE groups) at
the suite's bf16 loss tolerance 1e-3 (harness/compare/parity.py), weights and statistics not compared
(bf16-rounded updates and routing). The router
statistics equal the reference's (take_router_stats): routed slots summed over the ranks, the losses' mean
over every forward. DeepSpeed AutoEP (layout.ds_moe autoep) in the same launch: dp2 ep2 ZeRO-1 with the
losses and two micro-batches a rank, and ZeRO-2 with deepspeed.checkpointing per block on top-3 without
renormalisation, at the same fp32 bounds, with the same router statistics. What the facts refuse with MoE
is checked without processes (AutoEP's: tests/test_deepspeed_autoep.py).
"""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.testing.launches import shared_launch
from harness.testing.moe_parity import check_router_stats, reference_with_router, train_with_router
from harness.testing.reference import assert_grad_norms_match, assert_matches_reference
from harness.testing.workloads import tiny_workload

STEPS = 3
WORKLOAD = tiny_workload(model="tiny-moe", seq_len=16, steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0})
LAYOUT = {"engine": "deepspeed", "attention": "naive", "zero_stage": 1}
LOSSES = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
CASES = {  # id: (layout, workload overrides)
    "dp2-ep2": ({"dp": 2, "ep": 2}, {}),
    "dp2-ep1": ({"dp": 2}, {}),
    "dp2-ep2-losses-mb2": ({"dp": 2, "ep": 2, "micro_batch_size": 2}, LOSSES),
    "bf16-dp2-ep2": ({"dp": 2, "ep": 2}, {"precision": "bf16"}),
    "zero2-dp2-ep2-full-losses": ({"dp": 2, "ep": 2, "zero_stage": 2, "activation_checkpointing": "full"}, LOSSES),
    # DeepSpeed AutoEP (layout.ds_moe autoep, deepspeed/autoep.py): its own router and all-to-all, the
    # harness's losses on it, two micro-batches a rank
    "autoep-dp2-ep2-losses-mb2": ({"dp": 2, "ep": 2, "micro_batch_size": 2, "ds_moe": "autoep"}, LOSSES),
    # ZeRO-2 with deepspeed.checkpointing per block, top-3 without renormalisation (TopKGate cannot)
    "autoep-zero2-dp2-ep2-full-top3": (
        {"dp": 2, "ep": 2, "zero_stage": 2, "activation_checkpointing": "full", "ds_moe": "autoep"},
        {**LOSSES, "model_overrides": {"experts_per_token": 3, "norm_topk": False}},
    ),
    # ZeRO-3: the model built under zero.Init, AutoEP gathering each block and partitioning the experts it
    # builds over their expert-data-parallel group
    "autoep-zero3-dp2-ep2": ({"dp": 2, "ep": 2, "zero_stage": 3, "ds_moe": "autoep"}, LOSSES),
}


def _run(case) -> dict:
    layout, workload = case
    return {"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}}


results = shared_launch(
    "deepspeed", 2, train_with_router, [_run(c) for c in CASES.values()], STEPS, keys=CASES, threads=1
)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_the_reference(results, name):
    norms = []
    losses, state, ref_stats = reference_with_router(_run(CASES[name]), STEPS, norms)
    bf16 = CASES[name][1].get("precision") == "bf16"
    # DeepSpeed's own global norm (ZeRO's, the bf16 optimizer's: expert groups averaged over their
    # expert-data-parallel ranks, then combined with the dense groups') is the reference's
    assert_grad_norms_match(results[name]["grad_norms"], norms, name, 1e-3 if bf16 else 1e-5)
    if bf16:
        assert_matches_reference(results[name], losses, None, name, 1e-3)
        assert set(results[name]["state"]) == set(state)
        return
    assert_matches_reference(results[name], losses, state, name, 1e-5)
    check_router_stats(results[name]["router_stats"], ref_stats)
    moe = results[name]["describe"]["moe"]
    assert ("AutoEP" if "autoep" in name else "top2_2nd_expert_sampling=False") in moe, moe


REFUSED = [  # (layout, model overrides, reason)
    ({"tp": 2}, None, "set tp=pp=cp=1"),
    ({"pp": 2, "zero_stage": 1}, None, "set tp=pp=cp=1"),
    ({"zero_stage": 3}, None, "set zero_stage 1 or 2"),
    ({}, {"norm_topk": False}, "experts_per_token 2 with norm_topk true"),
    ({}, {"experts_per_token": 3}, "experts_per_token 2 with norm_topk true"),
]


@pytest.mark.parametrize("layout,overrides,reason", REFUSED, ids=["tp2", "pp2", "zero3", "top2-raw", "top3"])
def test_refused_before_launch(layout, overrides, reason):
    from harness.spec import parse_spec

    w = {**WORKLOAD, **({"model_overrides": overrides} if overrides else {})}
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": w, "layout": {**LAYOUT, **layout}})
    assert e.value.field == "workload.model" and reason in e.value.reason, e.value.reason


def test_a_declared_expert_group_is_on_the_ep_axis_whatever_its_ranks():
    """DeepSpeed's expert-parallel groups carry no group_desc, and at dp2 ep2 their ranks are the dp group's:
    the engine declares them (process_groups), and that declaration decides before the ranks do."""
    from types import SimpleNamespace

    from harness.parallel_dims import ParallelDims
    from harness.profiling.annotate import AxisOf

    group = SimpleNamespace()  # no ranks asked: resolved by the declaration alone
    assert AxisOf(ParallelDims(dp=2, ep=2), 0, {"ep": [group]})(group) == "ep"


@pytest.mark.parametrize("k", [1, 2])
def test_deepspeeds_gate_routes_as_the_reference(k):
    """TopKGate as deepspeed/experts.py builds it (dropless, no random token selection, no sampled second expert)
    picks the reference's experts with its weights (top-2 renormalised, top-1 the softmax weight: the only
    normalisations the facts let through), exactly: the same fp32 softmax, argmax for top-k."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.moe.sharded_moe import TopKGate

    from harness.model.moe import route

    torch.manual_seed(0)
    gate = TopKGate(64, 8, k=k, min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(32, 64)
    _, _, _, indices, _, weights, _ = gate(x, None, True)
    ref_weights, ref_experts, _ = route(torch.nn.functional.linear(x, gate.wg.weight), k, normalise=k == 2)
    assert torch.equal(indices.long().T, ref_experts)
    assert torch.equal(weights.T, ref_weights)


def test_deepspeed_names_are_the_references():
    """The gate's weight is the router's; local expert j on expert-parallel rank r is global r * E / ep + j."""
    from harness.frameworks.deepspeed.experts import plain_name
    from harness.model.presets import resolve_shape

    shape = resolve_shape("tiny-moe", {})
    prefix = "layers.1.feed_forward."
    assert plain_name(prefix + "deepspeed_moe.gate.wg.weight", shape, 2, 1) == prefix + "router.weight"
    expert = prefix + "deepspeed_moe.experts.deepspeed_experts.3.w2.weight"
    assert plain_name(expert, shape, 2, 1) == prefix + "experts.7.w2.weight"
    assert plain_name(expert, shape, 1, 0) == prefix + "experts.3.w2.weight"
    assert plain_name("layers.1.attention.wq.weight", shape, 2, 1) == "layers.1.attention.wq.weight"


@pytest.mark.slow
def test_census_counts_the_expert_groups_optimizer_states(results):
    """ZeRO-1/2 step their basic optimizer once per parameter group (the experts' apart from the dense
    one): AdamW's two fp32 moments per master element of every group, not the first group's alone
    (0.33P before: the census was taken after the first group's call). Each rank's masters are its
    dense partition and its experts' partition; the states are twice them, plus one fp32 step counter
    per group (4 bytes each). ZeRO-3 (AutoEP) steps it once per sub-group (0.66P before: the census
    counted param groups, not sub-groups)."""
    for name in ("dp2-ep2", "autoep-dp2-ep2-losses-mb2", "autoep-zero3-dp2-ep2"):  # AutoEP: DeepSpeed's groups
        census = results[name]["census"]
        masters, states = census["master_parameters"]["fp32"], census["optimizer_states"]["fp32"]
        groups = 2  # dense, experts (deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer)
        assert 2 * masters <= states <= 2 * masters + 4 * 2 * groups, (name, masters, states)
