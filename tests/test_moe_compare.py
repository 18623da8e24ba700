"""The mixture-of-experts comparison (examples/compare-cpu-moe.yaml): tiny-moe under every engine, 4
processes each, against the single-device reference at fp32's 1e-5, and each engine's router statistics
counted once per token (the routing section of the report)."""

from __future__ import annotations

import os

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-moe.yaml")


def test_the_example_runs_every_engine_and_ep_where_it_shares_out_experts():
    from harness.compare.spec import load_compare_spec

    cs = load_compare_spec(EXAMPLE)
    engines = {r.spec.layout.engine for r in cs.runs}
    assert engines == {"single", "own", "megatron", "deepspeed", "fsdp"}
    assert all(r.spec.shape().moe for r in cs.runs)
    assert {r.label for r in cs.runs if r.spec.layout.ep == 2} >= {"own dp4 ep2", "own tp2 dp2 ep2"}


# The example's 5 measured steps cut to 2 (and 1 profiled step, not 2): 6 runs of 4 processes on 2 cores;
# parity is a maximum over the steps compared, the routing an equality per measured step, so both hold on fewer.
STEPS = 2


@pytest.mark.slow
def test_every_engine_matches_the_reference_and_routes_the_same_tokens(tmp_path):
    """The example's runs over STEPS measured steps. Parity at 1e-5 (fp32: every engine routes in fp32 by the same rule,
    dropless, so the same experts see the same tokens and the sums differ by their order only); and the tokens per
    expert of the measured steps, summed over ranks, equal the reference's exactly: each engine's statistics count
    every routed token once, whatever its ranks hold (a top-k flip from rounding would show here first)."""
    from harness.compare.orchestrate import run_comparison
    from harness.report.compare import sections
    from harness.store import PASS
    from harness.testing.workloads import example_over

    cs = example_over(EXAMPLE, STEPS)
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, log_dir=str(tmp_path), profile_steps=1
    )
    assert all(len(losses) == 1 + STEPS for losses in summary["loss_curves"].values())  # warm-up + measured
    assert summary["verdict"] == PASS, [(r["label"], r["status"], r.get("error_line")) for r in summary["runs"]]
    routed = {r["label"]: r["metrics"]["router"]["tokens_per_expert"] for r in summary["runs"]}
    reference = next(routed[r["label"]] for r in summary["runs"] if r["is_reference"])
    for label, tokens in routed.items():
        assert tokens == reference, label
    titles = [s.title for s in sections(summary)]
    assert "Routing (mixture of experts)" in titles
    from harness.report.routing import routing_rows

    header, rows = routing_rows(summary)
    against = header.index("against the reference")
    assert all(row[against].startswith("equal") for row in rows if row[against] != "-"), rows


def test_routing_against_the_reference_counts_moved_slots():
    """A slot routed to another expert changes two counts by one: it is one moved slot, not two."""
    from harness.report.routing import against_reference

    ref = {"layers.0": [3, 5, 0, 8], "layers.1": [4, 4, 4, 4]}
    assert against_reference({k: list(v) for k, v in ref.items()}, ref) == "equal (2 layers)"
    moved = {"layers.0": [4, 4, 0, 8], "layers.1": [4, 4, 3, 5]}
    assert against_reference(moved, ref) == "2 of 32 slots moved"
    assert against_reference({"layers.0": [16]}, ref) == "other layers or experts"
    assert against_reference({}, ref) == "-"
