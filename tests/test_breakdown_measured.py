"""Issue 41 items 4-6: a breakdown that is measured (compute clocked, what no clock covers its own
component), labels that say what a call did (pp transfers apart from the bubble, one-rank groups, the
expert group), and Why naming every component that moved between runs that differ in one factor."""

from __future__ import annotations

from harness.report.data import Breakdown
from harness.report.why import Case, comparisons, explain, factors

BASE = {
    "activation_checkpointing": "none",
    "attention": "sdpa",
    "engine": "own",
    "micro_batch_size": 2,
    "pipeline_schedule": "1f1b",
    "rmsnorm": "torch",
    "sequence_parallel": False,
    "dp": 1,
    "tp": 1,
    "pp": 1,
}


def _case(label, ms, parts, layout=None, engine="own"):
    b = Breakdown(parts, sum(parts.values()), "measured steps")
    lay = dict(BASE, **(layout or {}))
    ci = (ms * 0.99e-3, ms * 1.01e-3)
    return Case(label, engine, label, ms / 1e3, b, ci, None, factors(lay))


def test_why_names_every_component_that_moved_either_way():
    # the committed report's megatron pp2 against megatron dp2: compute +12.6 ms was left out behind the bubble
    dp2 = _case("megatron dp2", 45.5, {"compute": 33.2, "dp_comm": 6.6, "wait": 1.7, "optimizer": 2.1, "other": 1.9})
    pp2 = _case("megatron pp2", 72.0, {"compute": 45.8, "dp_comm": 0.2, "bubble": 22.5, "optimizer": 1.7, "other": 1.8})
    text = explain(dp2, pp2)
    assert "pipeline bubble +22.5 ms (85% of the difference)" in text, text
    assert "compute +12.6 ms (48% of the difference)" in text, text
    assert "partly offset by exposed dp communication -6.4 ms" in text, text
    assert "optimizer" not in text  # -0.4 ms: under 10% of the difference


def test_an_engine_s_layouts_are_compared_only_where_one_factor_differs():
    parts = {"compute": 10.0, "tp_comm": 0.0, "dp_comm": 2.0}
    dp2 = _case("own dp2", 15.7, dict(parts), {"dp": 2})
    tp2 = _case("own tp2", 133.8, dict(parts, tp_comm=110.0, compute=23.8), {"tp": 2})
    naive = _case("own tp2 naive", 116.1, dict(parts, tp_comm=90.0, compute=24.1), {"tp": 2, "attention": "naive"})
    _, layouts = comparisons([dp2, tp2, naive])
    pairs = [s.split(" takes ")[0] + " / " + s.split(" than ")[1].split(" (")[0] for s in layouts if " takes " in s]
    # own tp2 naive against own dp2 changed the split and the kernel at once: never a pair
    assert "own tp2 naive / own dp2" not in pairs and "own tp2 / own dp2" in pairs, layouts
    assert "own tp2 / own tp2 naive" in pairs, layouts  # the kernel alone
    assert factors(dict(BASE, tp=2)).keys() == factors(dict(BASE, dp=2)).keys()


def test_a_run_no_other_run_is_one_factor_from_is_said_not_compared():
    parts = {"compute": 10.0, "dp_comm": 2.0}
    dp2 = _case("own dp2", 15.7, dict(parts), {"dp": 2})
    naive = _case("own tp2 naive", 116.1, dict(parts, compute=110.0), {"tp": 2, "attention": "naive"})
    _, layouts = comparisons([dp2, naive])
    assert layouts == [
        "Not compared (no run of the same engine differs from them in one layout field only): own tp2 naive."
    ]
