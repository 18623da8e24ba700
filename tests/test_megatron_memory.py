"""The planner's Megatron memory against Megatron-LM's theoretical estimate (benchmarks/megatron_memory.py,
which re-derives megatron/training/theoretical_memory_usage.py): the model states agree within 5% on every
layout, dense and MoE; every other difference is one of the named terms, which sum to the totals' gap."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from harness.model.presets import PRESETS

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "megatron_memory.py"
_spec = importlib.util.spec_from_file_location("megatron_memory", _path)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_at_least_six_layouts_dense_and_moe():
    models = [m for m, _, _ in bench.LAYOUTS]
    assert len(models) >= 6
    assert any(PRESETS[m].moe for m in models) and any(not PRESETS[m].moe for m in models)


@pytest.mark.parametrize("case", bench.LAYOUTS, ids=lambda c: f"{c[0]}-{sorted(c[1].items())}")
def test_model_states_within_5_percent_and_the_rest_named(case):
    c = bench.compare(*case)
    assert c["planner_states"] == pytest.approx(c["megatron_states"], rel=0.05)
    gap = c["planner_total"] - c["megatron_total"]
    named = sum(c["named"].values())
    assert gap - named == pytest.approx(c["planner_states"] - c["megatron_states"], abs=1.0)
    # the schedule's layers in flight on the fullest rank are Megatron's (its interleaved factor, min(1, m / pp))
    assert abs(c["named"]["layers in flight"]) <= 0.05 * c["megatron_activations"]


def test_the_estimate_follows_megatrons_formula_on_a_hand_case():
    """Llama 3 8B, tp 1, pp 1, dp 8, one 8192-token sequence, no recomputation: 8.03e9 parameters (untied
    embedding and output layer both on the rank) at 6 + 12 / 8 bytes; activations s b h (10 + 24) a layer,
    the embedding's 8 s b + s b h, the logits 2 s b (V + h), times 1.05."""
    s, h, V, L = 8192, 4096, 128256, 32
    est = bench.megatron_estimate(PRESETS["llama3-8b"], bench.layout(bench.LAYOUTS[0][1]), bench.LAYOUTS[0][2])
    attention = 2 * h * h * (1 + 8 / 32)
    params = L * (attention + 3 * h * 14336 + 2 * h) + 2 * h * V + h
    assert est["states"] == pytest.approx(params * 7.5, rel=1e-9)
    act = (s * h * 34 * L + 8 * s + s * h + 2 * s * (V + h)) * 1.05
    assert est["activations"] == pytest.approx(act, rel=1e-9)
