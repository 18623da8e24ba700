"""Engine megatron (Megatron-core 0.16 itself) against the single-device reference, on gloo processes:
every 2-rank case in one launch, the 8-rank case in another.

fp32, 1e-5 on every loss and every final weight: tp2, tp2 with SP (and full recomputation), pp2 1F1B,
pp2 interleaved with 2 virtual stages, dp2 with the DistributedOptimizer, dp2 DDP with selective
recomputation, pp2 with tied embeddings (Megatron's embedding group), tp2 SP with attention biases, llama3 rope
scaling and another eps and theta; tp2 x pp2 x dp2 (SP, DistributedOptimizer) on 8 ranks. Every case runs
under megatron_shim.tripwire(): a torch.cuda function the shim does not cover, reached by any of them, fails.
"""

from __future__ import annotations

import pytest

from harness.testing.reference import assert_matches_reference, reference_run
from harness.testing.spawn import spawn

pytestmark = pytest.mark.slow  # every test here starts processes

STEPS = 3
WORKLOAD = {"model": "tiny", "model_overrides": {"layers": 4}, "seq_len": 16, "global_batch_size": 8,
            "steps": STEPS, "warmup_steps": 0, "device": "cpu", "precision": "fp32",
            "optimizer": {"lr": 1.0, "eps": 1.0}}  # as harness/testing/equivalence.py: Adam's step follows the gradient
LAYOUT = {"engine": "megatron", "attention": "naive"}

TWO = {  # id: (layout, workload overrides)
    "tp2": ({"tp": 2}, {}),
}
EIGHT = {"tp2-sp-pp2-dp2-distopt": ({"tp": 2, "sequence_parallel": True, "pp": 2, "dp": 2, "zero_stage": 1}, {})}


def _run(case: tuple[dict, dict]) -> dict:
    layout, workload = case
    return {"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}}


def _train(ctx, runs: list[dict]) -> list[dict]:
    """Each run's engine in turn under the shim's tripwire: losses, final weights, census, describe,
    and the torch.cuda functions reached that the shim does not cover."""
    from harness.data.source import token_source
    from harness.frameworks import build_engine, megatron_shim
    from harness.spec import parse_spec

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        shape = spec.shape()
        with megatron_shim.tripwire() as reached:
            engine = build_engine(spec, shape, ctx)
            source = token_source(spec.workload, shape.vocab)
            losses = [float(engine.train_step(source.global_batch_at(step))) for step in range(STEPS)]
            state = engine.full_state_dict()
        out.append({"losses": losses, "state": state, "census": engine.memory_census(),
                    "describe": engine.describe(), "uncovered": sorted(reached)})
        del engine
    return out


@pytest.fixture(scope="module")
def two():
    return dict(zip(TWO, spawn(_train, 2, [_run(c) for c in TWO.values()], timeout_s=300, threads=1)))


@pytest.fixture(scope="module")
def eight():
    return dict(zip(EIGHT, spawn(_train, 8, [_run(c) for c in EIGHT.values()], timeout_s=300, threads=1)))


def _reference(case):
    run = _run(case)
    return reference_run(run["workload"], STEPS, micro_batch_size=run["layout"].get("micro_batch_size", 1),
                         attention="naive")


def _check(result, case, label):
    from harness.frameworks.megatron_shim import HARMLESS

    assert_matches_reference(result, *_reference(case), label)
    assert set(result["uncovered"]) <= set(HARMLESS), f"{label}: torch.cuda reached beyond the shim: " \
                                                      f"{result['uncovered']}"
    assert result["describe"]["framework"].startswith("megatron-core 0.16")
    assert "through the device shim" in result["describe"]["framework"]


@pytest.mark.parametrize("name", list(TWO))
def test_two_ranks_match_the_reference(two, name):
    _check(two[name], TWO[name], name)


@pytest.mark.parametrize("name", list(EIGHT))
def test_eight_ranks_match_the_reference(eight, name):
    _check(eight[name], EIGHT[name], name)
