"""The one MoE definition (harness/model/moe.py): routing, the two router losses, how their gradient
enters, the statistics a run records, and the expert-parallel groups carved from dp x cp."""

from __future__ import annotations

import pytest
import torch

from harness.errors import SpecError
from harness.model.moe import (
    MoEFeedForward,
    RouterInputs,
    combine_router_stats,
    imbalance,
    route,
    router_losses,
    router_record,
    set_router_losses,
    take_router_stats,
)
from harness.model.presets import PRESETS, active_param_count, param_count, resolve_shape
from harness.parallel_dims import ParallelDims
from harness.spec import parse_spec

TINY_MOE = PRESETS["tiny-moe"]


def _moe(seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    m = MoEFeedForward(TINY_MOE)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


@pytest.mark.parametrize("normalise", [True, False])
def test_route_takes_the_top_k_of_the_softmax(normalise):
    logits = torch.randn(32, 8)
    weights, experts, probs = route(logits, 2, normalise)
    assert torch.equal(experts, torch.topk(torch.softmax(logits, -1), 2).indices)
    if normalise:
        torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    else:
        torch.testing.assert_close(weights, torch.gather(probs, 1, experts))


def test_the_load_balancing_loss_is_one_when_routing_is_uniform():
    """Megatron's normalisation E/k Σ f_e P_e: every expert gets T·k/E slots and mean probability 1/E."""
    experts, k, tokens = 8, 2, 16
    counts = torch.full((experts,), tokens * k / experts)
    r = RouterInputs(counts, torch.full((experts,), tokens / experts), torch.tensor(0.0), tokens)
    aux, z = router_losses(r, k)
    assert float(aux) == pytest.approx(1.0)
    assert float(z) == 0.0


def test_router_inputs_are_additive_over_tokens():
    """Ranks holding parts of one micro-batch sum their RouterInputs: the losses of the sum are those
    of the whole."""
    logits = torch.randn(20, 8)
    _, experts, probs = route(logits, 2, True)
    whole = RouterInputs.of(logits, experts, probs)
    a, b = RouterInputs.of(logits[:7], experts[:7], probs[:7]), RouterInputs.of(logits[7:], experts[7:], probs[7:])
    summed = RouterInputs(a.counts + b.counts, a.prob_sum + b.prob_sum, a.z_sum + b.z_sum, a.tokens + b.tokens)
    for x, y in zip(router_losses(whole, 2), router_losses(summed, 2), strict=True):
        torch.testing.assert_close(x, y)
    z = torch.logsumexp(logits, -1)
    torch.testing.assert_close(router_losses(whole, 2)[1], (z * z).mean())


def test_the_aux_gradient_is_the_weighted_losses_gradient_scaled_per_micro_batch():
    """What AuxLossScaler injects equals differentiating out.sum() + scale·(a·aux + b·z) directly."""
    m, x = _moe(), torch.randn(2, 5, TINY_MOE.hidden)
    m.aux_coeff, m.z_coeff, m.aux_scale = 0.3, 0.05, 0.25
    m(x).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.aux_coeff = m.z_coeff = 0.0
    x2 = x.reshape(-1, TINY_MOE.hidden)
    weights, experts, probs, logits = m.gate(x2)
    aux, z = router_losses(RouterInputs.of(logits, experts, probs), m.k)
    (m.run_experts(x2, weights, experts).sum() + 0.25 * (0.3 * aux + 0.05 * z)).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-6, atol=1e-7)


def test_an_expert_no_token_reached_gets_a_zero_gradient_not_none():
    """AdamW skips a parameter whose grad is None but decays one whose grad is zero: every engine's
    flat buffers give zeros, so the reference must too."""
    m = _moe()
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0] = 10.0  # every token to experts 0 and the next best
    m(torch.ones(1, 4, TINY_MOE.hidden)).sum().backward()
    unused = [e for e, ex in m.experts.items() if not ex.w1.weight.grad.abs().sum()]
    assert unused and all(ex.w1.weight.grad is not None for ex in m.experts.values())


def test_statistics_count_forwards_not_a_checkpoint_recomputation():
    m, x = _moe(), torch.randn(1, 6, TINY_MOE.hidden, requires_grad=True)
    torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False).sum().backward()
    stats = take_router_stats(torch.nn.ModuleDict({"ffn": m}))["ffn"]
    assert stats["forwards"] == 1 and sum(stats["counts"]) == 6 * TINY_MOE.experts_per_token


def test_set_router_losses_reaches_every_layer():
    from harness.model.llama import build_model

    model = build_model(TINY_MOE, 1)
    set_router_losses(model, 0.01, 0.001, 4)
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    assert len(layers) == TINY_MOE.layers
    assert all((m.aux_coeff, m.z_coeff, m.aux_scale) == (0.01, 0.001, 0.25) for m in layers)


def test_a_step_sums_counts_over_ranks_and_averages_losses_over_forwards():
    a = {"layers.0.feed_forward": {"counts": [3.0, 1.0], "aux": 1.0, "z": 2.0, "forwards": 1}}
    b = {"layers.0.feed_forward": {"counts": [1.0, 3.0], "aux": 4.0, "z": 8.0, "forwards": 3}}
    step = combine_router_stats([a, b])["layers.0.feed_forward"]
    assert step == {"counts": [4.0, 4.0], "aux": 3.25, "z": 6.5, "forwards": 4}
    rec = router_record([combine_router_stats([a]), combine_router_stats([a, b])], warmup=1)
    assert rec["imbalance_max"] == [1.5, 1.0]
    assert rec["tokens_per_expert"] == {"layers.0.feed_forward": [4.0, 4.0]}
    assert imbalance([0, 0, 8, 0]) == 4.0


def test_parameter_counts_of_the_moe_presets():
    """Mixtral 8x7B's published 46.7B total and 12.9B active; Qwen3's names: 30B-A3B and 235B-A22B."""
    assert param_count(PRESETS["mixtral-8x7b"]) == pytest.approx(46.7e9, rel=2e-3)
    assert active_param_count(PRESETS["mixtral-8x7b"]) == pytest.approx(12.9e9, rel=2e-3)
    assert active_param_count(PRESETS["qwen3-30b-a3b"]) == pytest.approx(3.3e9, rel=0.03)
    assert active_param_count(PRESETS["qwen3-235b-a22b"]) == pytest.approx(22e9, rel=0.03)
    from harness.model.llama import Llama

    with torch.device("meta"):
        assert param_count(TINY_MOE) == sum(p.numel() for p in Llama(TINY_MOE).parameters())


@pytest.mark.parametrize(
    "dims", [ParallelDims(dp=4, ep=2), ParallelDims(dp=2, cp=2, tp=2, ep=4), ParallelDims(pp=2, dp=4, tp=2, ep=4)]
)
def test_expert_groups_tile_each_replica_group(dims):
    for r in range(dims.world):
        ep, edp = dims.expert_group_of(r), dims.expert_data_group_of(r)
        replicas = set(dims.flat_group_of(r))
        assert r in ep and r in edp and set(ep) <= replicas and set(edp) <= replicas
        assert len(ep) == dims.ep and len(edp) == dims.expert_data_parallel()
        assert set(ep) & set(edp) == {r}
        assert dims.expert_index(r) == ep.index(r)
    assert sorted(r for g in dims.expert_groups() for r in g) == list(range(dims.world))
    assert sorted(r for g in dims.expert_data_groups() for r in g) == list(range(dims.world))


def test_expert_groups_are_consecutive_data_parallel_ranks_as_megatron_orders_them():
    """Megatron's expert ranks tp-ep-dp-pp: ep inside the expert-data-parallel axis."""
    dims = ParallelDims(dp=4, tp=2, ep=2)
    assert dims.expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dims.expert_data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.label() == "tp2 dp4 ep2"


def _spec(model="tiny-moe", engine="single", **layout):
    return {"workload": {"model": model, "seq_len": 16, "global_batch_size": 4}, "layout": {"engine": engine, **layout}}


@pytest.mark.parametrize(
    "model, layout, field",
    [
        ("tiny", {"engine": "own", "dp": 2, "ep": 2}, "layout.ep"),
        ("tiny-moe", {"engine": "own", "dp": 3, "ep": 3}, "layout.ep"),
        ("tiny-moe", {"engine": "own", "dp": 2, "ep": 4}, "layout.ep"),
    ],
)
def test_ep_is_refused_where_it_cannot_share_out_experts(model, layout, field):
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": {"model": model, "seq_len": 16, "global_batch_size": 12}, "layout": layout})
    assert e.value.field == field


def test_a_moe_shape_needs_all_three_fields():
    with pytest.raises(SpecError, match="a MoE needs all three"):
        resolve_shape("tiny", {"experts": 4})
    with pytest.raises(SpecError, match="experts_per_token 5 > experts 4"):
        resolve_shape("tiny", {"experts": 4, "experts_per_token": 5, "moe_ffn": 32})
    assert resolve_shape("tiny", {"experts": 4, "experts_per_token": 1, "moe_ffn": 32}).moe


def test_the_reference_runs_a_moe():
    assert parse_spec(_spec()).shape().moe


def test_why_names_the_expert_load_of_moe_runs_and_not_of_dense_ones():
    from harness.report.data import Breakdown
    from harness.report.why import Case, explain

    def case(label, ms, imbalance):
        b = Breakdown({"compute": ms * 0.5, "ep_comm": ms * 0.5}, ms, "measured steps")
        return Case(label, "own", label, ms / 1e3, b, (ms / 1e3 * 0.99, ms / 1e3 * 1.01), imbalance)

    text = explain(case("ep2", 120.0, 1.62), case("ep1", 100.0, 1.31))
    assert "exposed ep communication +10.0 ms" in text
    assert "Expert load (tokens per expert, max over mean, worst layer): ep2 1.62, ep1 1.31." in text
    assert "Expert load" not in explain(case("a", 120.0, None), case("b", 100.0, None))


def test_an_empty_expert_batch_runs_under_fp8():
    """torchao's float8 linear takes the amax of its input, which an expert that receives no token has not
    (torch.max refuses an empty tensor): harness/model/float8.py runs that empty batch outside the cast, so
    its output is empty and its weight gradient zeros, as in bf16."""
    from harness.model import float8
    from harness.model.feed_forward import FeedForward

    for recipe in ("tensorwise", "rowwise"):
        ff = float8.convert(FeedForward(64, 96).to(torch.bfloat16), recipe, "cpu")
        assert float8.float8_linears(ff)
        x = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
        y = ff(x)
        y.sum().backward()
        assert y.shape == (0, 64) and all(torch.equal(p.grad, torch.zeros_like(p)) for p in ff.parameters())
        ff(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()  # a non-empty batch takes torchao's path
    spec = _spec()
    spec["workload"]["precision"] = "fp8"
    parse_spec(spec)


def test_ep_names_a_layout_apart_from_the_same_degrees_without_it():
    """Why pairs 'the same layout under other engines' by the label less the engine: ep2 is not ep1's."""
    from harness.report.data import layout_key

    assert layout_key({"engine": "own", "dp": 4, "ep": 2}) != layout_key({"engine": "fsdp", "dp": 4})
    assert layout_key({"engine": "own", "dp": 4, "ep": 2}) == layout_key({"engine": "megatron", "dp": 4, "ep": 2})
