"""Engine megatron (Megatron-core 0.16 itself) against the single-device reference, on gloo processes:
every 2-rank case in one launch, the 8-rank case in another.

fp32, 1e-5 on every loss and every final weight: tp2, tp2 with SP (and full recomputation), pp2 1F1B,
pp2 interleaved with 2 virtual stages, dp2 with the DistributedOptimizer, dp2 DDP with selective
recomputation, pp2 with tied embeddings (Megatron's embedding group), tp2 SP with attention biases, llama3 rope
scaling and another eps and theta; tp2 x pp2 x dp2 (SP, DistributedOptimizer) on 8 ranks. Every case runs
under megatron_shim.tripwire(): a torch.cuda function the shim does not cover, reached by any of them, fails.

Under the bf16 policy (Megatron's bf16: bf16 parameters, fp32 main gradients, fp32 masters and Adam states),
1e-3 against the bf16 reference (the suite's bf16 tolerance: harness/compare/parity.py) at dp2 with and
without the DistributedOptimizer, tp2 SP, pp2, and with bf16 main gradients; and the memory census at dp=2
against the own engine's closed form (tests/test_census_own.py) and the own engine's own census, measured in
the same launch.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

from harness.testing.launches import shared_launch
from harness.testing.reference import assert_matches_reference, reference_run
from harness.testing.workloads import tiny_workload

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 3
WORKLOAD = tiny_workload(
    model_overrides={"layers": 4}, seq_len=16, steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0}
)  # as harness/testing/equivalence.py: Adam's step follows the gradient
LAYOUT = {"engine": "megatron", "attention": "naive"}

BF16 = {"precision": "bf16"}
LLAMA3 = {
    "model_overrides": {
        "layers": 4,
        "attention_bias": True,
        "rope_factor": 8.0,
        "rope_theta": 500000.0,
        "norm_eps": 1e-6,
    }
}
TIED = {"model_overrides": {"layers": 4, "tie_embeddings": True}}
TWO = {  # id: (layout, workload overrides)
    "tp2": ({"tp": 2}, {}),
    "tp2-sp-full": ({"tp": 2, "sequence_parallel": True, "activation_checkpointing": "full"}, {}),
    "pp2-1f1b": ({"pp": 2}, {}),
    "pp2-interleaved-v2": ({"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2}, {}),
    "dp2-distopt": ({"dp": 2, "zero_stage": 1}, {}),
    "dp2-ddp-selective-mb2": ({"dp": 2, "activation_checkpointing": "selective", "micro_batch_size": 2}, {}),
    "pp2-tied": ({"pp": 2}, TIED),
    "tp2-sp-bias-llama3": ({"tp": 2, "sequence_parallel": True}, LLAMA3),
    "bf16-dp2-distopt": ({"dp": 2, "zero_stage": 1}, BF16),
    "bf16-dp2-ddp": ({"dp": 2}, BF16),
    "bf16-tp2-sp": ({"tp": 2, "sequence_parallel": True}, BF16),
    "bf16-pp2": ({"pp": 2}, BF16),
    "bf16-dp2-distopt-bf16-grads": (
        {"dp": 2, "zero_stage": 1},
        {**BF16, "grad_accum_dtype": "bf16", "grad_reduce_dtype": "bf16"},
    ),
    "own-bf16-dp2-zero1": ({"engine": "own", "dp": 2, "zero_stage": 1}, BF16),
}
FP32_CASES = [n for n, (lay, w) in TWO.items() if w.get("precision") != "bf16"]
BF16_CASES = [n for n, (lay, w) in TWO.items() if w.get("precision") == "bf16" and "engine" not in lay]
EIGHT = {"tp2-sp-pp2-dp2-distopt": ({"tp": 2, "sequence_parallel": True, "pp": 2, "dp": 2, "zero_stage": 1}, {})}


def _run(case: tuple[dict, dict]) -> dict:
    layout, workload = case
    return {"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}}


def _train(ctx, runs: list[dict]) -> list[dict]:
    """Each run's engine in turn under the shim's tripwire: losses, final weights, census, describe,
    and the torch.cuda functions reached that the shim does not cover."""
    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.frameworks.megatron import shim as megatron_shim
    from harness.spec import parse_spec

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        shape = spec.shape()
        with megatron_shim.tripwire() as reached:  # (the own engine's case passes through it untouched)
            engine = build_engine(spec, shape, ctx)
            source = token_source(spec.workload, shape.vocab)
            losses = [float(engine.train_step(source.global_batch_at(step))) for step in range(STEPS)]
            state = engine.full_state_dict()
        out.append(
            {
                "losses": losses,
                "state": state,
                "census": engine.memory_census(),
                "describe": engine.describe(),
                "uncovered": sorted(reached),
            }
        )
        del engine
    return out


two = shared_launch("megatron", 2, _train, [_run(c) for c in TWO.values()], keys=TWO, threads=1)
eight = shared_launch("megatron", 8, _train, [_run(c) for c in EIGHT.values()], keys=EIGHT, threads=1)


def _reference(case):
    run = _run(case)
    return reference_run(
        run["workload"], STEPS, micro_batch_size=run["layout"].get("micro_batch_size", 1), attention="naive"
    )


def _check(result, case, label, rtol=1e-5, weights=True):
    from harness.frameworks.megatron.shim import HARMLESS

    losses, state = _reference(case)
    assert_matches_reference(result, losses, state if weights else None, label, rtol)
    assert set(result["uncovered"]) <= set(HARMLESS), (
        f"{label}: torch.cuda reached beyond the shim: {result['uncovered']}"
    )
    assert result["describe"]["framework"].startswith(f"megatron-core {version('megatron-core')} ")  # the one run
    assert "through the device shim" in result["describe"]["framework"]


@pytest.mark.parametrize("name", FP32_CASES)
def test_two_ranks_match_the_reference(two, name):
    _check(two[name], TWO[name], name)


@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_matches_the_bf16_reference(two, name):
    """Losses at the suite's bf16 tolerance (final weights are bf16-rounded updates: not compared)."""
    _check(two[name], TWO[name], name, rtol=1e-3, weights=False)
    assert two[name]["describe"]["precision_policy"].startswith("bf16 parameters for compute, fp32 master")


def _units(census: dict, p: int) -> dict:
    """The census in multiples of P, by category and dtype (empty categories left out)."""
    return {cat: {dt: round(b / p, 2) for dt, b in by.items()} for cat, by in census.items() if by}


D = 2
# Megatron at dp=d in bf16 with fp32 main gradients, per rank, in units of P (the model's parameter count):
#   parameters         bf16 2P: the model's parameters (ZeRO-1: views into DDP's contiguous param buffer)
#   gradients          fp32 4P: DDP's main-gradient buffer (the masters' .grad are views of it)
#   master_parameters  fp32 4P/d (DistributedOptimizer's shards) or 4P (Float16Optimizer's copies)
#   optimizer_states   fp32 8P/d or 8P: AdamW's exp_avg and exp_avg_sq (and a 4-byte step per tensor)
# the own engine's closed form (tests/test_census_own.py): its ZeRO-1 reduce-scatters in place into its main
# gradients as the DistributedOptimizer does, so it holds 4P of gradients too.
CENSUS = {
    "bf16-dp2-distopt": {
        "parameters": {"bf16": 2},
        "gradients": {"fp32": 4},
        "master_parameters": {"fp32": 4 / D},
        "optimizer_states": {"fp32": 8 / D},
    },
    "bf16-dp2-ddp": {
        "parameters": {"bf16": 2},
        "gradients": {"fp32": 4},
        "master_parameters": {"fp32": 4},
        "optimizer_states": {"fp32": 8},
    },
    "dp2-distopt": {"parameters": {"fp32": 4}, "gradients": {"fp32": 4}, "optimizer_states": {"fp32": 8 / D}},
}


def _p() -> int:
    from harness.model.presets import param_count
    from harness.spec import parse_spec

    return param_count(parse_spec(_run(TWO["tp2"])).shape())


@pytest.mark.parametrize("name", list(CENSUS))
def test_census_is_the_closed_form(two, name):
    """Megatron's padding (each parameter's start to 64 elements, buckets to a multiple of dp, with the
    DistributedOptimizer) is under 3% here."""
    census, p, form = two[name]["census"], _p(), CENSUS[name]
    assert {k: set(v) for k, v in census.items() if v} == {k: set(v) for k, v in form.items()}, census
    for category, by_dtype in form.items():
        for dtype, units in by_dtype.items():
            assert abs(census[category][dtype] - units * p) <= 0.03 * units * p, (category, _units(census, p))


def test_census_matches_the_own_engines_zero1(two):
    """own dp2 ZeRO-1 against megatron dp2 with the DistributedOptimizer, bf16: the same categories and
    dtypes, the same multiples of P (gradients: 4P in both, each reduce-scattering into its main-gradient
    buffer)."""
    p = _p()
    own, megatron = _units(two["own-bf16-dp2-zero1"]["census"], p), _units(two["bf16-dp2-distopt"]["census"], p)
    assert {k: set(v) for k, v in own.items()} == {k: set(v) for k, v in megatron.items()}, (own, megatron)
    for category in ("parameters", "gradients", "master_parameters", "optimizer_states"):
        for dtype, units in megatron[category].items():
            assert abs(own[category][dtype] - units) <= 0.03 * units, (category, own, megatron)
    assert abs(megatron["gradients"]["fp32"] - 4) <= 0.12


@pytest.mark.parametrize("name", list(EIGHT))
def test_eight_ranks_match_the_reference(eight, name):
    _check(eight[name], EIGHT[name], name)
