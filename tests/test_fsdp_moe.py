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
refuse with MoE (tp, cp; with ep compile, and fp8 with pp) is checked without processes.

Expert parallelism (fsdp/experts.py) in the same launches: dp2 ep2 (dp_mod_ep of one rank) with the losses and
two micro-batches a rank, with full checkpointing (the dispatch run again in recomputation), in bf16 without the
router losses, as the own engine's bf16 case (at its bf16 tolerances, harness.testing.equivalence, whose
derivation holds here: both sides compute in bf16 and differ where sums are ordered differently; the routed
slots' total exact, as tests/test_engine_moe.py says why; measured 2.6e-5 on a loss, 5.6e-3 of a tensor's
scale; with the losses at 0.1/0.01 the router's weight is 1.07e-2 off, and 1.18e-2 at ep 1: not held to 1e-2);
on 4 ranks dp4 ep2 (the experts reduce-scattered over a dp_mod_ep of two ranks, divided by dp) and pp2 dp2 ep2
under 1F1B and ZBV. An expert gradient divided by the wrong factor moves the weights far outside 1e-5 (measured
with it divided twice: the first gradient norm 0.3% off). The all-to-alls are counted exactly: per rank, layer
and micro-batch 3 in the forward (counts, dispatch, combine), 2 in the backward, 3 more in full checkpointing's
recomputation; the fp32 census holds rank 0's experts sharded over dp_mod_ep and the rest over dp, exactly.

FP8 experts under ep (harness.model.float8, mxfp8.py) at the fp8 tolerances (harness.testing.equivalence): dp2 ep2
tensorwise with fp8_all_gather, rowwise with full checkpointing, mxfp8, and on 4 ranks dp4 ep2 tensorwise with the
experts' FP8 weights all-gathered over two ranks. Measured before the tests, dp2 ep2 without fp8_all_gather:
tensorwise 1.5e-4 on a loss and 4.7e-2 of a tensor's scale (wo; the own engine's layout gives the same to 1e-6),
rowwise 8.4e-5 and 3.5e-2 (mxfp8 bit for bit rowwise's at tiny-moe's widths, the reference's too). The routed
slots' totals are exact; the counts may move at near ties only, as tests/test_engine_moe.py's docstring derives (an
expert's dynamic scales are amaxes over the ep group's micro-batches: moe_parity.check_router_counts_near, measured
4 and 10 slots moved by layer under tensorwise, 8 and 8 under rowwise). The census holds the fp32 masters as in
fp32, and under fp8_all_gather one fp32 scale per converted weight of the rank (the experts' included).
"""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.model import float8
from harness.model.presets import resolve_shape
from harness.parallel_dims import ParallelDims
from harness.spec import parse_spec
from harness.testing.equivalence import (
    BF16_LOSS_RTOL,
    BF16_WEIGHTS_RTOL,
    FP8_LOSS_RTOL,
    FP8_WEIGHTS_RTOL,
    MXFP8_LOSS_RTOL,
    MXFP8_WEIGHTS_RTOL,
)
from harness.testing.launches import shared_launch
from harness.testing.moe_parity import (
    check_router_counts_near,
    check_router_stats,
    reference_with_router,
    train_with_router,
)
from harness.testing.reference import assert_grad_norms_match, assert_matches_reference
from harness.testing.workloads import tiny_workload

STEPS = 3
K = resolve_shape("tiny-moe", {}).experts_per_token
TOLERANCES = FP8_LOSS_RTOL, FP8_WEIGHTS_RTOL
WORKLOAD = tiny_workload(model="tiny-moe", seq_len=16, steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0})
LAYOUT = {"engine": "fsdp", "attention": "naive"}
LOSSES = {"moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}
FP8 = {recipe: {"precision": "fp8", "fp8_recipe": recipe} for recipe in ("tensorwise", "rowwise", "mxfp8")}
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
    "dp2-ep2-losses-mb2": ({"dp": 2, "ep": 2, "micro_batch_size": 2}, LOSSES),
    "dp2-ep2-full-losses": ({"dp": 2, "ep": 2, "activation_checkpointing": "full"}, LOSSES),
    "dp2-ep2-bf16": ({"dp": 2, "ep": 2}, {"precision": "bf16"}),
    # FP8 experts (module docstring): tensorwise, with FSDP2's FP8 all-gather, rowwise, mxfp8
    "dp2-ep2-fp8-tensorwise-all-gather": ({"dp": 2, "ep": 2, "fp8_all_gather": True}, FP8["tensorwise"]),
    "dp2-ep2-fp8-rowwise-full": ({"dp": 2, "ep": 2, "activation_checkpointing": "full"}, FP8["rowwise"]),
    "dp2-ep2-mxfp8": ({"dp": 2, "ep": 2}, FP8["mxfp8"]),
}
CASES4 = {  # on 4 ranks, in the session's 4-rank launch
    "dp4-ep2-losses": ({"dp": 4, "ep": 2}, LOSSES),
    "pp2-dp2-ep2-1f1b-losses": ({"pp": 2, "dp": 2, "ep": 2, "pipeline_schedule": "1f1b"}, LOSSES),
    "pp2-dp2-ep2-zbv-losses": (
        {"pp": 2, "dp": 2, "ep": 2, "pipeline_schedule": "zbv", "reshard_after_forward": False},
        {**LOSSES, "model_overrides": {"layers": 4}},
    ),
    # the experts' FP8 weights all-gathered over a dp_mod_ep of two ranks (gloo: as their bytes)
    "dp4-ep2-fp8-tensorwise-all-gather": ({"dp": 4, "ep": 2, "fp8_all_gather": True}, FP8["tensorwise"]),
}


def _run(case) -> dict:
    layout, workload = case
    return {"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}}


results = shared_launch("torch", 2, train_with_router, [_run(c) for c in CASES.values()], STEPS, keys=CASES, threads=1)
four = shared_launch("torch", 4, train_with_router, [_run(c) for c in CASES4.values()], STEPS, keys=CASES4, threads=1)


def _check(result: dict, run: dict, name: str) -> None:
    norms, ties = [], {}
    losses, state, ref_stats = reference_with_router(run, STEPS, norms, ties)
    precision, recipe = run["workload"].get("precision"), run["workload"].get("fp8_recipe")
    if precision == "fp8":
        loss_rtol, weights_rtol = (MXFP8_LOSS_RTOL, MXFP8_WEIGHTS_RTOL) if recipe == "mxfp8" else TOLERANCES
        assert_matches_reference({"losses": result["losses"]}, losses, None, name, loss_rtol)
        assert_matches_reference(result, losses, state, name, weights_rtol)
        summed = {
            layer: [sum(s[layer]["counts"][e] for s in result["router_stats"] if s and layer in s) for e in range(n)]
            for layer, n in ((layer, len(ref["counts"])) for layer, ref in ref_stats.items())
        }
        check_router_counts_near(summed, {k: v["counts"] for k, v in ref_stats.items()}, ties, K)
    elif precision == "bf16":
        assert_matches_reference({"losses": result["losses"]}, losses, None, name, BF16_LOSS_RTOL)
        assert_matches_reference(result, losses, state, name, BF16_WEIGHTS_RTOL)
        for layer, ref in ref_stats.items():  # every routed slot counted once
            assert sum(sum(s[layer]["counts"]) for s in result["router_stats"]) == sum(ref["counts"]), layer
    else:
        assert_matches_reference(result, losses, state, name, 1e-5)
        assert_grad_norms_match(result["grad_norms"], norms, name)  # the norm FSDP2's clipping used
        check_router_stats(result["router_stats"], ref_stats)
    lay = run["layout"]
    if lay.get("ep", 1) == 1:
        assert "every expert on every rank" in result["describe"]["moe"] and not result["comm"]
        return
    assert "all_to_all_single" in result["describe"]["moe"]
    # rank 0's groups named for the profiler: ep's (at dp = ep the dp group's ranks), dp_mod_ep's beyond one rank
    dims = ParallelDims.of(lay)
    edp = [dims.expert_data_group_of(0)] if lay["dp"] > lay["ep"] else []
    assert result["process_groups"] == {"ep": [dims.expert_group_of(0)], "dp": edp}, result["process_groups"]
    spec = parse_spec(run)
    micro = spec.workload.global_batch_size // lay["dp"] // lay.get("micro_batch_size", 1)
    passes = spec.shape().layers // lay.get("pp", 1) * micro  # this rank's layers' forwards in a step
    recomputed = lay.get("activation_checkpointing") == "full"
    counted = result["comm"]["ep"]["all_to_all"]
    assert counted["count"] == passes * (5 + 3 * recomputed), counted
    # each forward's exchange of the counts: E int64 numbers
    assert counted["bytes_by_dtype"]["int64"] == passes * (1 + recomputed) * spec.shape().experts * 8, counted
    if lay.get("pp", 1) == 1 and spec.workload.precision in ("fp32", "fp8"):
        # rank 0 holds experts [0, E/ep) sharded over dp_mod_ep (dp / ep ranks), the rest over dp: FSDP2's
        # padded Shard(0) rows, and AdamW's two states beside them with its step (one fp32 scalar a parameter)
        # (fp8 alike: the fp32 masters are the sharded parameters), and under fp8_all_gather one fp32 scale for
        # each of rank 0's converted weights (float8.converts: no head, router or embedding, dims whole blocks)
        shape, held = spec.shape(), range(spec.shape().experts // lay["ep"])
        expected = count = converted = 0
        for name, t in state.items():
            expert = ".experts." in name
            if expert and int(name.split(".experts.")[1].split(".")[0]) not in held:
                continue
            ranks = lay["dp"] // lay["ep"] if expert else lay["dp"]
            expected += -(-t.shape[0] // ranks) * (t.numel() // t.shape[0]) * 4
            count += 1
            linear = t.dim() == 2 and name.split(".")[-2] not in ("tok_embeddings", "output", "router")
            converted += linear and all(d % float8.align(recipe or "") == 0 for d in t.shape)
        assert result["census"]["parameters"] == {"fp32": expected}, (result["census"], expected, shape.experts)
        assert result["census"]["optimizer_states"] == {"fp32": 2 * expected + 4 * count}, result["census"]
        if precision == "fp8":
            scales = {"fp32": 4 * converted} if lay.get("fp8_all_gather") else {}
            assert result["census"]["fp8"] == scales, (result["census"], converted)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_the_reference(results, name):
    _check(results[name], _run(CASES[name]), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES4))
def test_moe_on_four_ranks_matches_the_reference(four, name):
    _check(four[name], _run(CASES4[name]), name)


REFUSED = {  # id: (layout, workload overrides, field, reason)
    "tp2": ({"tp": 2}, {}, "workload.model", "does not shard the router and experts"),
    "cp2": ({"cp": 2, "attention": "sdpa"}, {}, "workload.model", "not additive over tokens"),
    "ep2-compile": ({"dp": 2, "ep": 2, "compile": "blocks"}, {"warmup_steps": 1}, "layout.compile", "runs eager"),
    "pp2-ep2-fp8": (
        {"pp": 2, "dp": 2, "ep": 2, "pipeline_schedule": "1f1b"},
        {"precision": "fp8"},
        "workload.precision",
        "fp8 with ep > 1 and pp > 1",
    ),
    "ep4-dp2": ({"dp": 2, "ep": 4}, {}, "layout.ep", "does not divide dp x cp"),
    "ep2-dense": ({"dp": 2, "ep": 2}, {"model": "tiny"}, "layout.ep", "this model has none"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_before_launch(name):
    layout, workload, field, reason = REFUSED[name]
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": {**WORKLOAD, **workload}, "layout": {**LAYOUT, **layout}})
    assert e.value.field == field and reason in e.value.reason, e.value.reason


@pytest.mark.parametrize("name", [*CASES, *CASES4])
def test_the_launched_layouts_are_accepted(name):
    """What the launches run passes the spec's checks (their refusals are the cases above)."""
    assert parse_spec(_run({**CASES, **CASES4}[name])).layout.engine == "fsdp"


def test_the_refusals_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import yaml

    from harness.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    lay = {"engine": "fsdp", "pp": 2, "dp": 2, "ep": 2, "pipeline_schedule": "1f1b"}
    raw = {"workload": {**WORKLOAD, "precision": "fp8"}, "layout": lay}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(raw))
    assert cli_main(["train", "t.yaml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: workload.precision: fp8 with ep > 1 and pp > 1"), err


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


def test_harness_memory_traces_the_expert_parallel_layer_with_even_routing():
    """With ep > 1 the layer takes its counts from BuildOptions.routing on fake tensors (no data there), as the own
    engine's does; the trace says so."""
    from harness.memtrace.result import trace_spec

    raw = {**WORKLOAD, "global_batch_size": 8, "precision": "bf16"}
    r = trace_spec(parse_spec({"workload": raw, "layout": {"engine": "fsdp", "dp": 2, "ep": 2}}))
    assert r["traced_peak_gib"] > 0
    assert any("routing even" in line for line in r["substitutions"])


def test_the_experts_parameters_are_told_apart_by_name_checkpoint_wrapped_or_not():
    """Clipping and the norm take the experts (dp_mod_ep's DTensors) apart from the rest (dp's)."""
    from harness.frameworks.fsdp.grad_norm import split_experts

    named = [
        ("layers.0._checkpoint_wrapped_module.feed_forward.experts.4.w1.weight", "e4"),
        ("layers.0._checkpoint_wrapped_module.feed_forward.router.weight", "router"),
        ("layers.1.feed_forward.experts.5.w2.weight", "e5"),
        ("output.weight", "head"),
    ]
    assert split_experts(named, True) == [["router", "head"], ["e4", "e5"]]
    assert split_experts(named, False) == [["e4", "router", "e5", "head"]]
