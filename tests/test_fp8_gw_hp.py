"""fp8_recipe rowwise_with_gw_hp (torchao's ROWWISE_WITH_GW_HP) and its weight gradient accumulated in fp32 into
the main gradient (harness.model.float8._FusedWeightGradient, Megatron's gradient_accumulation_fusion): the
fused product is the fp32 product of the bf16 operands, the same tokens split over two GEMMs give it to fp32
rounding (what makes an expert's batch under ep, two micro-batches in one GEMM, the reference's), forward and
input gradient are torchao's own, and what is not fused stays torchao's. The engines' side (slow) is
tests/test_engine_moe.py's dp2 ep2 case, whose router counts equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

from harness.errors import SpecError
from harness.model import float8
from harness.model.training import precision_policy
from harness.spec import parse_spec

GW_HP = "rowwise_with_gw_hp"


def _run(recipe: str, xs: list[torch.Tensor], gs: list[torch.Tensor], main_grad: bool):
    """One FP8 linear's backward over each (input, output gradient) pair: (weight, input gradients)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(96, 64, dtype=torch.bfloat16))
    if main_grad:
        weight.main_grad = torch.zeros(96, 64)
    mm, grads = float8.matmul(recipe, "cpu"), []
    for x, g in zip(xs, gs, strict=True):
        x = x.clone().requires_grad_()
        (mm(x, weight) * g).sum().backward()
        grads.append(x.grad)
    return weight, grads


def _operands(rows: int = 64):
    torch.manual_seed(1)
    return torch.randn(rows, 64, dtype=torch.bfloat16), torch.randn(rows, 96, dtype=torch.bfloat16)


def test_the_recipe_is_torchaos_and_leaves_the_weight_gradient_uncast():
    cfg = float8.config(GW_HP, "cpu")
    disabled = float8.torchao_float8().float8_linear.ScalingType.DISABLED
    assert cfg.cast_config_input_for_grad_weight.scaling_type is disabled
    assert cfg.cast_config_grad_output_for_grad_weight.scaling_type is disabled
    assert float8._high_precision_weight_gradient(cfg)
    assert not float8._high_precision_weight_gradient(float8.config("rowwise", "cpu"))


def test_the_fused_weight_gradient_is_the_fp32_product_and_the_rest_torchaos():
    x, g = _operands()
    fused, fused_gi = _run(GW_HP, [x], [g], main_grad=True)
    plain, plain_gi = _run(GW_HP, [x], [g], main_grad=False)
    exact = g.float().t() @ x.float()
    assert torch.equal(fused.main_grad, exact)  # bf16 products are exact in fp32; one fp32 GEMM
    assert fused.grad_added_to_main_grad and not fused.grad.any()  # the hook's add is skipped, a zero arrives
    assert torch.equal(fused_gi[0], plain_gi[0])  # the input gradient: torchao's FP8 one
    assert plain.grad.dtype == torch.bfloat16 and not torch.equal(plain.grad.float(), exact)  # torchao's bf16 product


def test_split_tokens_give_the_fused_sum_to_fp32_rounding_and_not_the_bf16_one():
    """An expert's batch under ep (two micro-batches' tokens in one GEMM) against the reference's two GEMMs:
    fused, the sums differ by fp32 rounding (2^-24 per add, a few ulps over 64 terms); as torchao's bf16
    products added in fp32, by bf16 rounding (2^-9 relative per product)."""
    x, g = _operands()
    whole, _ = _run(GW_HP, [x], [g], main_grad=True)
    split, _ = _run(GW_HP, [x[:40], x[40:]], [g[:40], g[40:]], main_grad=True)
    scale = whole.main_grad.abs().max()
    assert (split.main_grad - whole.main_grad).abs().max() <= 64 * 2**-24 * scale
    bf16_whole, _ = _run(GW_HP, [x], [g], main_grad=False)
    parts = [_run(GW_HP, [x[a:b]], [g[a:b]], main_grad=False)[0].grad.float() for a, b in ((0, 40), (40, 64))]
    assert (parts[0] + parts[1] - bf16_whole.grad.float()).abs().max() > 64 * 2**-24 * scale


def test_a_recipe_with_an_fp8_weight_gradient_is_not_fused():
    x, g = _operands()
    weight, _ = _run("rowwise", [x], [g], main_grad=True)
    assert not weight.main_grad.any() and weight.grad is not None and weight.grad.dtype == torch.bfloat16


def test_an_empty_batch_runs_unconverted_and_unfused():
    weight, grads = _run(GW_HP, [torch.zeros(0, 64, dtype=torch.bfloat16)], [torch.zeros(0, 96)], main_grad=True)
    assert not weight.main_grad.any() and not weight.grad.any() and grads[0].shape == (0, 64)


def _spec(recipe: str, layout: dict | None = None, **workload):
    return parse_spec(
        {
            "workload": {"model": "tiny-moe", "seq_len": 16, "precision": "fp8", "fp8_recipe": recipe, **workload},
            "layout": {"engine": "own", **(layout or {})},
        }
    )


def test_the_policy_fuses_only_this_recipe_with_fp32_main_gradients():
    assert precision_policy(_spec(GW_HP).workload).fuses_weight_gradient
    assert "accumulated in fp32 into the main gradients" in precision_policy(_spec(GW_HP).workload).describe()
    assert not precision_policy(_spec("rowwise").workload).fuses_weight_gradient
    assert not precision_policy(_spec(GW_HP, grad_accum_dtype="bf16").workload).fuses_weight_gradient


def test_the_reference_hands_its_main_gradients_to_the_linears():
    from harness.model.training import MasterWeights

    p = torch.nn.Parameter(torch.ones(16, 16, dtype=torch.bfloat16))
    weights = MasterWeights([p], precision_policy(_spec(GW_HP).workload))
    assert p.main_grad is weights.main_grads[0] and p.main_grad.dtype == torch.float32
    p.main_grad += 2.0
    p.grad, p.grad_added_to_main_grad = torch.full_like(p, 5.0), True  # fused: the add already happened
    weights.after_backward()
    assert p.grad is None and not p.grad_added_to_main_grad and torch.equal(p.main_grad, torch.full((16, 16), 2.0))
    p.grad = torch.full_like(p, 5.0)  # not fused (an empty expert's batch): added as always
    weights.after_backward()
    assert torch.equal(weights.main_grads[0], torch.full((16, 16), 7.0))


def test_the_own_engine_refuses_it_under_the_split_backward():
    shape = {"model_overrides": {"layers": 4}}
    with pytest.raises(SpecError, match="rowwise_with_gw_hp with pipeline_schedule zbv"):
        _spec(GW_HP, {"pp": 2, "pipeline_schedule": "zbv"}, **shape)
    _spec("rowwise", {"pp": 2, "pipeline_schedule": "zbv"}, **shape)


def test_the_moe_example_runs_the_own_engine_with_and_without_ep_under_this_recipe():
    """examples/compare-cpu-moe-2proc.yaml's fp8 precision group: its parity and exact routing under ep are
    what tests/test_engine_moe.py's rowwise_with_gw_hp dp2 ep2 case checks in the shared launch."""
    import os

    from harness.compare.spec import DEFAULT_TOLERANCE, load_compare_spec

    cs = load_compare_spec(os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-moe-2proc.yaml"))
    group = next(g for g in cs.groups if g.precision == "fp8")
    runs = {r.label: r.spec for r in cs.runs if r.label in group.labels}
    assert {s.workload.fp8_recipe for s in runs.values()} == {GW_HP}
    assert sorted((s.layout.engine, s.layout.ep) for s in runs.values()) == [("own", 1), ("own", 2), ("single", 1)]
    assert group.tolerance == DEFAULT_TOLERANCE["fp8"]  # 5.7e-3: bf16's x sqrt(2^5), rounded
