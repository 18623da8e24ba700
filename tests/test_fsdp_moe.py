"""Engine fsdp's mixture of experts (the plain model's MoEFeedForward under FSDP2, every expert on every rank)
against the single-device reference: one 2-rank launch.

tiny-moe (8 experts, top-2, renormalised), seq 16, 3 steps, fp32: 1e-5 on every loss and every final weight
(the suite's fp32 tolerance: the same sums in another order, ~1e-7 relative per step; routing is discrete,
and no top-k choice sits within rounding of a tie at seed 1234). Cases: dp2; dp2 with nonzero load-balancing
and z-loss coefficients and two micro-batches a rank (the losses' gradient scale 1/micro-batches of the
rank, then FSDP2's mean over dp: the reference's 1/micro-batches of the whole batch; the coefficients move
the step-3 loss well beyond the tolerance, so a wrong scale fails); the same with full activation
checkpointing (the router's recomputation in backward is not counted); pp2 (torch.distributed.pipelining,
each stage reporting its own layer) with the losses under GPipe, 1F1B and ZBV (its split backward: the aux
gradient in the input-gradient pass; 4 layers for its two stages a rank). The router statistics equal the reference's
(take_router_stats): routed slots summed over the ranks, the losses' mean over every forward. What the facts
refuse with MoE (tp, cp, ep) is checked without processes.
"""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.testing.launches import shared_launch
from harness.testing.moe_parity import check_router_stats, reference_with_router, train_with_router
from harness.testing.reference import assert_grad_norms_match, assert_matches_reference
from harness.testing.workloads import tiny_workload

STEPS = 3
WORKLOAD = tiny_workload(model="tiny-moe", seq_len=16, steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0})
LAYOUT = {"engine": "fsdp", "attention": "naive"}
LOSSES = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
CASES = {  # id: (layout, workload overrides)
    "dp2": ({"dp": 2}, {}),
    "dp2-losses-mb2": ({"dp": 2, "micro_batch_size": 2}, LOSSES),
    "dp2-full-losses": ({"dp": 2, "activation_checkpointing": "full"}, LOSSES),
    "pp2-losses": ({"pp": 2, "pipeline_schedule": "gpipe"}, LOSSES),
    "pp2-1f1b-losses": ({"pp": 2, "pipeline_schedule": "1f1b"}, LOSSES),
    "pp2-zbv-losses": (
        {"pp": 2, "pipeline_schedule": "zbv", "reshard_after_forward": False},
        {**LOSSES, "model_overrides": {"layers": 4}},  # two stages a rank
    ),
}


def _run(case) -> dict:
    layout, workload = case
    return {"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}}


results = shared_launch("torch", 2, train_with_router, [_run(c) for c in CASES.values()], STEPS, keys=CASES, threads=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_the_reference(results, name):
    norms = []
    losses, state, ref_stats = reference_with_router(_run(CASES[name]), STEPS, norms)
    assert_matches_reference(results[name], losses, state, name, 1e-5)
    assert_grad_norms_match(results[name]["grad_norms"], norms, name)  # the norm FSDP2's clipping used
    check_router_stats(results[name]["router_stats"], ref_stats)
    assert "every expert on every rank" in results[name]["describe"]["moe"]


REFUSED = [  # (layout, field, reason)
    ({"tp": 2}, "workload.model", "does not shard the router and experts"),
    ({"cp": 2, "attention": "sdpa"}, "workload.model", "not additive over tokens"),
    ({"dp": 2, "ep": 2}, "layout.ep", "DTensor all-to-all"),
]


@pytest.mark.parametrize("layout,field,reason", REFUSED, ids=["tp2", "cp2", "ep2"])
def test_refused_before_launch(layout, field, reason):
    from harness.spec import parse_spec

    with pytest.raises(SpecError) as e:
        parse_spec({"workload": WORKLOAD, "layout": {**LAYOUT, **layout}})
    assert e.value.field == field and reason in e.value.reason, e.value.reason


def test_harness_memory_refuses_a_moe_in_one_line(tmp_path, monkeypatch, capsys):
    """Fake tensors have no shape for the tokens each plain MoE layer's expert gets (torch.nonzero): one line,
    exit 2, not a traceback from inside the trace."""
    import yaml

    from harness.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"workload": WORKLOAD, "layout": {"engine": "fsdp", "dp": 2}}))
    assert cli_main(["memory", "t.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [err[0]] and err[0].startswith("error: workload.model: mixture of experts: engine fsdp"), err
