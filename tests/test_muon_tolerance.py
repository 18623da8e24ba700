"""The comparison's Muon term (harness/compare/muon_tolerance.py): the per-step bound measured against bf16
Newton-Schulz itself, the term's formula, and the comparison applying it to Muon runs only (quick: no
processes)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.compare.muon_tolerance import BF16_UNIT_ROUNDOFF, matrix_bounds, ns_lipschitz, quintic_max, relative_bounds
from harness.compare.parity import FAIL, PASS, check_parity
from harness.compare.spec import parse_compare_spec
from harness.model.muon import COEFFICIENTS, newton_schulz
from harness.spec import parse_spec

NS_STEPS = 5  # torch.optim.Muon's DEFAULT_NS_STEPS, as harness.model.muon runs it


def _gradient_like(shape, decades: int, seed: int) -> torch.Tensor:
    """A bf16 policy's main gradient: two bf16 micro-batch gradients summed in fp32 (such sums often sit on a
    bf16 rounding tie, so a 1e-7 change flips Newton-Schulz's bf16 cast of them), singular values spread
    log-uniformly over `decades` decades (the tiny model's attention.wo gradient: condition number 1e4)."""
    g = torch.Generator().manual_seed(seed)
    u, _, v = torch.linalg.svd(torch.randn(*shape, generator=g), full_matrices=False)
    m = u @ torch.diag(torch.logspace(0, -decades, min(shape))) @ v
    h = torch.randn(*shape, generator=g) * m.abs().mean() * 0.1
    return (m - h).bfloat16().float() + h.bfloat16().float()


def _pair(shape, decades: int, seed: int, dtype=torch.bfloat16) -> tuple[float, float]:
    """(||O - O'||_F, ||O||_F): Newton-Schulz on a matrix and on a copy 1e-7 apart relatively (two runs' fp32
    sums of the same micro-batches in another order)."""
    g = _gradient_like(shape, decades, seed)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(100 + seed))
    o = newton_schulz(g, dtype).double()
    o2 = newton_schulz(g * (1 + 1e-7 * noise), dtype).double()
    return float((o - o2).norm()), float(o.norm())


@pytest.mark.parametrize("shape", [(64, 64), (32, 64), (176, 64), (64, 176)])
@pytest.mark.parametrize("decades", [0, 4])
def test_bf16_newton_schulz_of_a_reduction_order_difference_is_inside_the_per_step_bound(shape, decades):
    """The per-step bound 2 s_max sqrt(min(m, n)) holds (bf16's outputs stay under s_max), as does 2 u a^5
    (one rounding of the normalised input, amplified along its smallest direction), and what they bound is no
    fp32 effect: bf16 turns a 1e-7 input difference into half a rounding of the output or more, and on an
    ill-conditioned input (4 decades) into several (measured 9-19 u here, 10-15 u on the tiny model's wo
    gradient: above the 2 x 5 steps x u of rounding each iterate once); fp32's stays near 1e-6."""
    pairs = [_pair(shape, decades, seed) for seed in range(8)]
    worst = max(d / o for d, o in pairs)
    s_max = quintic_max(COEFFICIENTS, NS_STEPS)
    for d, o in pairs:
        assert o <= s_max * math.sqrt(min(shape)) * (1 + 2 * BF16_UNIT_ROUNDOFF)  # bf16's last rounding
        assert d <= 2 * s_max * math.sqrt(min(shape))
        assert d <= 2 * BF16_UNIT_ROUNDOFF * ns_lipschitz(COEFFICIENTS, NS_STEPS)
    assert worst >= BF16_UNIT_ROUNDOFF / 2
    if decades:
        assert worst > NS_STEPS * BF16_UNIT_ROUNDOFF
    fp32 = max(d / o for d, o in (_pair(shape, decades, seed, torch.float32) for seed in range(8)))
    assert fp32 < 1e-4  # in fp32 the same inputs give the same update: fp32's tolerance holds there


def test_the_quintic_bounds_are_torchs_coefficients():
    """p(s) = 3.4445 s - 4.7750 s^3 + 2.0315 s^5 peaks at s^2 = 0.3075 (1.2024) on [0, 1] and maps [0, 1.2024]
    into itself; p^5's steepest slope on [0, 1] is at 0 (a^5): what a dense grid finds too."""
    a, b, c = COEFFICIENTS
    s = torch.linspace(0, 1, 200001, dtype=torch.float64, requires_grad=True)
    x = s
    for _ in range(NS_STEPS):
        x = a * x + b * x**3 + c * x**5
        assert float(x.detach().max()) <= quintic_max(COEFFICIENTS, NS_STEPS) + 1e-12
    (slope,) = torch.autograd.grad(x.sum(), s)
    assert float(slope.abs().max()) == pytest.approx(ns_lipschitz(COEFFICIENTS, NS_STEPS))
    assert quintic_max(COEFFICIENTS, NS_STEPS) == pytest.approx(1.2024, abs=1e-4)


WORKLOAD = {"model": "tiny", "seq_len": 32, "global_batch_size": 8, "steps": 6, "warmup_steps": 1}


def test_the_bound_is_steps_times_lr_times_the_largest_update():
    """B = T lr_adjusted 2 s_max sqrt(min(m, n)) per Muon matrix (torch's 'original' adjustment:
    sqrt(max(1, m/n))); none under fp32 or AdamW."""
    w = parse_spec({"workload": {**WORKLOAD, "precision": "bf16", "optimizer": {"name": "muon", "lr": 0.02}}})
    bounds = matrix_bounds(w.shape(), w.workload)
    per_step = 2 * quintic_max(COEFFICIENTS, NS_STEPS)
    assert bounds["layers.0.attention.wo.weight"] == pytest.approx(7 * 0.02 * per_step * 8)  # 64 x 64
    assert bounds["layers.1.feed_forward.w1.weight"] == pytest.approx(7 * 0.02 * math.sqrt(176 / 64) * per_step * 8)
    assert "tok_embeddings.weight" not in bounds and "norm.weight" not in bounds
    for other in ({"precision": "fp32", "optimizer": {"name": "muon"}}, {"precision": "bf16"}):
        s = parse_spec({"workload": {**WORKLOAD, **other}})
        assert matrix_bounds(s.shape(), s.workload) == {}


def test_the_comparison_carries_the_bounds_of_bf16_muon_only():
    def spec(precision: str, optimizer: str):
        workload = {**WORKLOAD, "precision": precision, "device": "cpu", "optimizer": {"name": optimizer}}
        return parse_compare_spec({"name": "t", "nproc": 2, "workload": workload, "runs": [{"engine": "own"}]})

    assert len(spec("bf16", "muon").muon_bounds) == 14  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3)
    assert spec("fp32", "muon").muon_bounds == {} and spec("bf16", "adamw").muon_bounds == {}


def _run(label, weights, reference=False, losses=(5.0, 4.9)):
    return {
        "label": label,
        "status": "ok",
        "is_reference": reference,
        "losses": list(losses),
        "metrics": {"grad_norms": [1.0, 0.9], "weights_fingerprint": {n: list(v) for n, v in weights.items()}},
    }


REF = {"layers.0.w.weight": (0.8, 0.1), "norm.weight": (8.0, 1.0)}


def test_parity_adds_a_bound_below_the_weights_scale_to_that_matrix_only():
    """B / ||W|| = 0.05 / 0.8: a Muon matrix 5e-3 off passes (FAIL without the bound); a norm 2e-3 off fails."""
    ref, bounds = _run("ref", REF, reference=True), {"layers.0.w.weight": 0.05}
    run = _run("run", {**REF, "layers.0.w.weight": (0.804, 0.1)})
    assert check_parity([ref, run], 2, 1e-3)["verdict"] == FAIL
    par = check_parity([ref, run], 2, 1e-3, bounds)
    assert par["verdict"] == PASS and par["weights"]["within"]
    assert par["weights"]["muon_bounds"] == {"layers.0.w.weight": pytest.approx(0.0625)}
    norm_off = _run("run", {**REF, "norm.weight": (8.016, 1.0)})
    assert check_parity([ref, norm_off], 2, 1e-3, bounds)["runs"][1]["note"].startswith("final weights: norm.weight")


def test_parity_leaves_out_a_matrix_whose_bound_reaches_its_scale_and_keeps_losses():
    """B / ||W|| = 1.25: that matrix's final weights are not compared (the note says why), whatever they are;
    the AdamW tensors' weights and the losses keep the precision's tolerance."""
    ref, bounds = _run("ref", REF, reference=True), {"layers.0.w.weight": 1.0}
    run = _run("run", {**REF, "layers.0.w.weight": (0.4, 0.3)})
    par = check_parity([ref, run], 2, 1e-3, bounds)
    assert par["verdict"] == PASS and "1 Muon matrices are not compared" in par["weights"]["muon_left_out"]
    assert relative_bounds(bounds, None) == {}  # no fingerprint to scale by: nothing left out
    off = _run("run", {**REF, "layers.0.w.weight": (0.4, 0.3)}, losses=(5.0, 4.9 * 1.002))
    assert check_parity([ref, off], 2, 1e-3, bounds)["verdict"] == FAIL


def test_fsdp_masters_start_as_the_references_under_bf16():
    """FSDP2's fp32 shards are its masters; the reference's masters are its bf16 parameters upcast
    (MasterWeights): FSDP2 loads the reference weights rounded through bf16, bit for bit the reference's
    masters (unrounded, they differed by up to half a bf16 ulp, and after one AdamW step its weights by 6.8e-5
    where own's matched to 5e-10: the difference Muon's Newton-Schulz then amplified)."""
    from harness.frameworks.fsdp.engine import _load_reference_shards
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.model.llama import Llama, ReferenceWeights

    spec = parse_spec({"workload": {**WORKLOAD, "precision": "bf16", "device": "cpu"}})
    reference = SingleDeviceEngine(spec, spec.shape(), torch.device("cpu"))
    with torch.device("meta"):
        model = Llama(spec.shape())
    model = model.to_empty(device="cpu")
    _load_reference_shards(model, ReferenceWeights(spec.shape(), spec.workload.seed), torch.bfloat16)
    masters = dict(zip(reference.names, reference.weights.optimizer_params(), strict=True))
    assert all(torch.equal(p, masters[n]) for n, p in model.named_parameters())
    _load_reference_shards(model, ReferenceWeights(spec.shape(), spec.workload.seed))  # fp32: unrounded
    assert not all(torch.equal(p, masters[n]) for n, p in model.named_parameters())
