"""Engine megatron's mixture of experts (Megatron-core's MoELayer: TopKRouter, alltoall dispatcher,
SequentialMLP experts) against the single-device reference's harness/model/moe.py: one 2-rank launch, one 4-rank.

tiny-moe (8 experts, top-2, renormalised), seq 16, 3 steps, fp32: 1e-5 on every loss and every final weight
(the suite's fp32 tolerance: the same sums in another order, ~1e-7 relative per step here; routing is
discrete, and no top-k choice sits within rounding of a tie at seed 1234). 2 ranks: dp2 ep2 (each rank four
of the eight experts, tokens exchanged by all-to-all); dp2 ep1; dp2 ep2 with nonzero load-balancing and
z-loss coefficients (Megatron's aux_loss and z-loss are the reference's: layer_spec.moe_config; they move
the step-3 loss by ~1.6e-4, 16x the tolerance) and two micro-batches a step, so the losses' 1/micro-batches
scale counts; the same losses under the DistributedOptimizer (the experts' own over the expert-data-parallel
group) with full recomputation (the router's second forward, in backward, not counted); bf16 dp2 ep2 with
the DistributedOptimizer at the bf16 tolerance. 4 ranks: tp2 with sequence parallelism x dp2 x ep2 with both
losses, and pp2 x dp2 x ep2; Qwen3-MoE's attention and routing (q/k norms, a head wider than hidden /
heads, q/k/v biases, top-k weights not renormalised) at dp2 ep2 and at tp2 SP dp2 ep2. The router
statistics (megatron/routers.py) equal the reference's
(take_router_stats): the routed slots summed over the ranks, the losses' mean over them. Every case runs
under the shim's tripwire.
"""

from __future__ import annotations

import pytest

from harness.testing.launches import shared_launch
from harness.testing.moe_parity import check_router_stats, reference_with_router, train_with_router
from harness.testing.reference import assert_grad_norms_match, assert_matches_reference
from harness.testing.workloads import tiny_workload

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 3
WORKLOAD = tiny_workload(
    model="tiny-moe", seq_len=16, steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0}
)  # as tests/test_megatron.py: Adam's step follows the gradient
LAYOUT = {"engine": "megatron", "attention": "naive"}
LOSSES = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
# Qwen3-MoE's attention and routing on tiny-moe: per-head q/k RMSNorms, a head twice hidden / heads wide, the
# top-k weights not renormalised (Megatron's pre-softmax routing), and Qwen2's q/k/v biases
QWEN = {"model_overrides": {"qk_norm": True, "kv_channels": 32, "norm_topk": False, "qkv_bias": True}}
CASES = {  # id: (layout, workload overrides)
    "dp2-ep2": ({"dp": 2, "ep": 2}, {}),
    "dp2-ep1": ({"dp": 2}, {}),
    "dp2-ep2-losses-mb2": ({"dp": 2, "ep": 2, "micro_batch_size": 2}, LOSSES),
    "dp2-ep2-distopt-full-losses": ({"dp": 2, "ep": 2, "zero_stage": 1, "activation_checkpointing": "full"}, LOSSES),
    "bf16-dp2-ep2-distopt": ({"dp": 2, "ep": 2, "zero_stage": 1}, {"precision": "bf16"}),
    "qwen3-moe-dp2-ep2": ({"dp": 2, "ep": 2}, QWEN),
}
FOUR = {  # world 4
    "tp2-sp-dp2-ep2-losses": ({"tp": 2, "sequence_parallel": True, "dp": 2, "ep": 2}, LOSSES),
    "pp2-dp2-ep2": ({"pp": 2, "dp": 2, "ep": 2}, {}),
    # the q/k norms' gradients: each tp rank normalised its own heads, finalize_model_grads sums them
    "qwen3-moe-tp2-sp-dp2-ep2": ({"tp": 2, "sequence_parallel": True, "dp": 2, "ep": 2}, QWEN),
}


def _run(case) -> dict:
    layout, workload = case
    return {"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}}


results = shared_launch(
    "megatron", 2, train_with_router, [_run(c) for c in CASES.values()], STEPS, True, keys=CASES, threads=1
)
four = shared_launch(
    "megatron", 4, train_with_router, [_run(c) for c in FOUR.values()], STEPS, True, keys=FOUR, threads=1
)


def _reference(case):
    """The reference's losses, final weights and last step's router statistics."""
    return reference_with_router(_run(case), STEPS)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_the_reference(results, name):
    """bf16 (Megatron's bf16 against the bf16 reference): the losses at the suite's bf16 tolerance 1e-3
    (harness/compare/parity.py), the final weights and statistics not compared (bf16-rounded updates and
    routing); the fp32 masters still gathered whole from the two optimizers' shards."""
    if CASES[name][1].get("precision") == "bf16":
        losses, state, _ = _reference(CASES[name])
        assert_matches_reference(results[name], losses, None, name, 1e-3)
        assert set(results[name]["state"]) == set(state)
        return
    _check(results[name], CASES[name], name)


@pytest.mark.parametrize("name", list(FOUR))
def test_moe_on_four_ranks_matches_the_reference(four, name):
    """Under tp2 with sequence parallelism each tp rank routes half of each sequence: the router
    statistics are summed over tp before the losses; pp2: each stage reports its own layer."""
    _check(four[name], FOUR[name], name)


def _check(result, case, name):
    from harness.frameworks.megatron.shim import HARMLESS

    norms = []
    losses, state, ref_stats = reference_with_router(_run(case), STEPS, norms)
    assert_matches_reference(result, losses, state, name, 1e-5)
    assert_grad_norms_match(result["grad_norms"], norms, name)  # Megatron's clip_grad_norm_fp32 over every rank
    uncovered = result["uncovered"]
    assert set(uncovered) <= set(HARMLESS), f"{name}: torch.cuda reached beyond the shim: {uncovered}"
    assert "SequentialMLP" in result["describe"]["moe"]
    check_router_stats(result["router_stats"], ref_stats)  # the runner's sum over ranks
