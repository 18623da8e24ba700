"""Engine megatron's mixture of experts without processes: Megatron-core's router under the engine's config
routes and weighs as harness.model.moe.route, its two losses are harness.model.moe.router_losses, the expert
weights map to and from SequentialMLP's per expert-parallel rank, and what the facts refuse.
Parity on real steps: tests/test_megatron_moe.py."""

from __future__ import annotations

import pytest
import torch

import harness.frameworks.megatron  # noqa: F401  (before Megatron's own imports below: sets NO_VCS_VERSION)
from harness.errors import SpecError
from harness.spec import parse_spec

TINY_MOE = {"model": "tiny-moe", "seq_len": 16, "global_batch_size": 8, "steps": 1, "warmup_steps": 0}
OK = {"engine": "megatron", "attention": "naive"}


def _spec(layout=None, workload=None, overrides=None):
    w = {**TINY_MOE, **(workload or {})}
    if overrides:
        w["model_overrides"] = overrides
    return parse_spec({"workload": w, "layout": {**OK, **(layout or {})}})


@pytest.mark.parametrize("norm_topk", [True, False])
def test_megatrons_routing_is_the_references(norm_topk):
    """topk_routing_with_score_function with moe_config's fields: the same experts, the same weights
    (renormalised or not), to fp32 rounding (a softmax over k logits against p / sum p: a few ulps)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    from harness.frameworks.megatron.layer_spec import moe_config
    from harness.model.moe import route

    spec = _spec(overrides={"norm_topk": norm_topk})
    shape, cfg = spec.shape(), moe_config(spec.shape(), spec)
    logits = torch.randn(64, shape.experts, generator=torch.Generator().manual_seed(0))
    probs, routing_map = topk_routing_with_score_function(
        logits, cfg["moe_router_topk"], use_pre_softmax=cfg["moe_router_pre_softmax"], score_function="softmax"
    )
    weights, experts, _ = route(logits, shape.experts_per_token, shape.norm_topk)
    want = torch.zeros_like(logits).scatter(1, experts, weights)
    assert torch.equal(routing_map, want > 0)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-7)


def test_megatrons_losses_are_the_references():
    """switch_load_balancing_loss_func and z_loss_func (coefficient 1) on one micro-batch against
    router_losses, and under sequence parallelism (tokens per expert summed over the tp ranks, each rank its
    probabilities, the z coefficient / tp) their sums over the two ranks' halves."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func, z_loss_func

    from harness.model.moe import RouterInputs, route, router_losses

    e, k, t = 8, 2, 32
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(1))
    _, experts, probs = route(logits, k, True)
    aux, z = router_losses(RouterInputs.of(logits, experts, probs), k)
    counts = torch.zeros(t, e).scatter(1, experts, 1.0).sum(dim=0)
    lb = switch_load_balancing_loss_func(probs, counts, t, k, e, 1.0)
    torch.testing.assert_close(lb, aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(z_loss_func(logits, 1.0), z, rtol=1e-6, atol=0)
    halves = [slice(0, t // 2), slice(t // 2, t)]
    lb_sp = sum(switch_load_balancing_loss_func(probs[h], counts, t, k, e, 1.0) for h in halves)
    z_sp = sum(z_loss_func(logits[h], 1.0 / 2) for h in halves)
    torch.testing.assert_close(lb_sp, aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(z_sp, z, rtol=1e-6, atol=0)


def test_expert_weights_map_per_expert_parallel_rank():
    """Local expert l of ep rank r is global expert r * E/ep + l; its fc1 is [w1; w3] per tp rank (as the dense
    MLP's), fc2 w2's columns; round trip over tp; the router whole."""
    from harness.frameworks.megatron.weights import is_expert, megatron_shard, plain_names, plain_tensors

    shape = _spec().shape()
    numbers = {0: 1, 1: 2}
    fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    fc2 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert plain_names(fc1, numbers, False, first_expert=4) == [
        "layers.1.feed_forward.experts.7.w1.weight",
        "layers.1.feed_forward.experts.7.w3.weight",
    ]
    assert plain_names(fc2, numbers, False, first_expert=4) == ["layers.1.feed_forward.experts.7.w2.weight"]
    assert plain_names("decoder.layers.0.mlp.router.weight", numbers, False) == ["layers.0.feed_forward.router.weight"]
    assert is_expert(fc1) and not is_expert("decoder.layers.0.mlp.router.weight")
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(shape.moe_ffn, shape.hidden, generator=g) for _ in range(2))
    w2 = torch.randn(shape.hidden, shape.moe_ffn, generator=g)
    for tp in (1, 2):
        shards = [megatron_shard(fc1, [w1, w3], shape, tp, r) for r in range(tp)]
        assert torch.equal(shards[-1], torch.cat([w1.chunk(tp)[-1], w3.chunk(tp)[-1]]))
        got = plain_tensors(fc1, shards, shape)
        assert torch.equal(got[0], w1) and torch.equal(got[1], w3)
        (back,) = plain_tensors(fc2, [megatron_shard(fc2, [w2], shape, tp, r) for r in range(tp)], shape)
        assert torch.equal(back, w2)


REFUSED = [  # (layout, model overrides, reason)
    ({"tp": 2}, None, "only with sequence parallelism"),
    ({}, {"experts_per_token": 1}, "top-1 routing renormalised"),
]


@pytest.mark.parametrize("layout,overrides,reason", REFUSED, ids=["tp-without-sp", "top1-renormalised"])
def test_refused_before_launch(layout, overrides, reason):
    with pytest.raises(SpecError) as e:
        _spec(layout, overrides=overrides)
    assert e.value.field == "workload.model" and reason in e.value.reason, e.value.reason


@pytest.mark.parametrize(
    "layout,workload,overrides",
    [
        ({"dp": 2, "ep": 2}, {"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}, None),
        ({"tp": 2, "sequence_parallel": True, "pp": 2, "dp": 2, "ep": 2, "zero_stage": 1}, {}, None),
        ({"dp": 4, "ep": 4}, {}, {"experts_per_token": 1, "norm_topk": False}),
    ],
    ids=["ep2-losses", "tp-sp-pp-ep-distopt", "top1-unnormalised"],
)
def test_taken(layout, workload, overrides):
    _spec(layout, workload, overrides)
