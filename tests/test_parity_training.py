"""Parity that proves training and the census of every optimizer group, without
processes: the default comparison's data makes the reference's loss fall, parity covers every trained step,
each step's gradient norm and the final weights, the headline says how many steps, DeepSpeed's
one-group-at-a-time optimizer step leaves no group's states out of the census, the report defines N and P."""

from __future__ import annotations

import copy

import pytest
import torch

from harness.compare.parity import FAIL, PASS, check_parity
from harness.compare.spec import DEFAULT, load_compare_spec, parse_compare_spec
from harness.data.source import MARKOV_ALPHABET, MarkovTokens, SyntheticTokens, token_source
from harness.measure.census import CensusAtStep, optimizer_state_tensors
from harness.measure.weights import fingerprint_rel_diff, weights_fingerprint
from harness.report.compare_steps import census_text, flop_text
from harness.report.policy import reasons
from harness.spec import parse_spec
from harness.testing.reference import reference_run

REF = [5.5, 5.0, 4.6, 4.3]
NORMS = [2.0, 1.5, 1.2, 1.0]


# ------------------------------------------------------------------ data whose loss falls


def test_default_comparison_reference_loss_falls_a_fifth_within_its_steps():
    """The single-device reference on the default workload (the compared steps: warm-up included):
    at least 20% below its first loss by the last step (42.7% measured: 5.48 -> 3.14 over 10 steps)."""
    w = copy.deepcopy(DEFAULT["workload"])
    steps = w["warmup_steps"] + w["steps"]
    losses, _ = reference_run(w, steps, micro_batch_size=2)
    assert len(losses) == steps
    assert losses[-1] <= 0.8 * losses[0], losses
    assert losses[w["warmup_steps"]] > losses[-1]  # the measured steps themselves still fall


def test_random_tokens_stay_available_and_hold_the_loss_near_ln_vocab():
    w = copy.deepcopy(DEFAULT["workload"])
    w["data"] = {"kind": "synthetic"}
    spec = parse_spec({"workload": w})
    assert isinstance(token_source(spec.workload, 256), SyntheticTokens)
    losses, _ = reference_run(w, 4, micro_batch_size=2)
    assert all(abs(x - 5.545) < 0.1 for x in losses), losses  # ln 256: nothing to learn in 4 steps


def test_markov_tokens_are_the_same_for_every_rank_and_differ_by_step():
    a, b = MarkovTokens(256, 64, 8, 1234), MarkovTokens(256, 64, 8, 1234)
    assert torch.equal(a.global_batch_at(3), b.global_batch_at(3))
    assert not torch.equal(a.global_batch_at(3), a.global_batch_at(4))
    batch = a.global_batch_at(0)
    assert batch.shape == (8, 65) and batch.dtype == torch.int64
    assert len(batch.unique()) <= MARKOV_ALPHABET and int(batch.max()) < 256
    # every transition is one of its token's successors: the chain is what the source says
    seen = {}
    for row in batch.tolist():
        for x, y in zip(row, row[1:], strict=False):
            seen.setdefault(x, set()).add(y)
    assert max(len(s) for s in seen.values()) <= 2
    assert len(MarkovTokens(8, 16, 2, 1).tokens) == 8  # a vocabulary smaller than the alphabet


# ------------------------------------------------------------------ parity over every step, gradient norms


def test_parity_covers_every_trained_step_by_default():
    cs = load_compare_spec(None)
    w = DEFAULT["workload"]
    assert cs.parity_steps == w["warmup_steps"] + w["steps"]
    raw = copy.deepcopy(DEFAULT)
    raw["parity_steps"] = 4  # still a choice a spec can make: the headline then says "of the 10"
    assert parse_compare_spec(raw).parity_steps == 4


def _runs(norms_b, losses_b=None, norms_c="same"):
    return [
        {"label": "ref", "status": "ok", "losses": REF, "is_reference": True, "grad_norms": NORMS},
        {"label": "b", "status": "ok", "losses": losses_b or REF, "grad_norms": norms_b, "engine": "own"},
        {"label": "c", "status": "ok", "losses": REF, "engine": "fsdp", "metrics": {"grad_norms": None}}
        if norms_c is None
        else {"label": "c", "status": "ok", "losses": REF, "metrics": {"grad_norms": NORMS}},
    ]


def test_gradient_norms_are_compared_at_the_loss_tolerance():
    p = check_parity(_runs([g * (1 + 5e-6) for g in NORMS]), 4, 1e-5)
    assert p["verdict"] == PASS and p["grad_norms"]["compared"] == ["ref", "b", "c"]
    assert p["grad_norms"]["max_pairwise_rel_diff"] == pytest.approx(5e-6, rel=1e-3)
    off = [2.0, 1.5, 1.2 * (1 + 1e-4), 1.0]  # losses equal, one norm off: the run fails
    p = check_parity(_runs(off), 4, 1e-5)
    b = next(r for r in p["runs"] if r["label"] == "b")
    assert b["verdict"] == FAIL and b["grad_norm_worst_step"] == 2 and "gradient norm at step 2" in b["note"]
    assert p["verdict"] == FAIL


def test_a_run_without_gradient_norms_is_named_with_its_reason_and_its_loss_verdict_stands():
    p = check_parity(_runs(NORMS, norms_c=None), 4, 1e-5)
    assert p["verdict"] == PASS
    assert p["grad_norms"]["compared"] == ["ref", "b"]
    assert "fsdp computed none" in p["grad_norms"]["not_compared"]["c"]


def test_headline_says_how_many_steps_and_the_gradient_norms():
    par = check_parity(_runs(NORMS), 4, 1e-5)
    summary = {"parity": par, "runs": [], "fingerprints": {"same": True}}
    text = "; ".join(reasons(summary))
    assert "over 4 steps" in text and "gradient norms agree across 3 run(s)" in text
    par = check_parity(_runs(NORMS), 3, 1e-5)  # a spec that compares fewer steps than the runs trained
    assert "over 3 of the 4 trained steps" in "; ".join(reasons({**summary, "parity": par}))


# ------------------------------------------------------------------ the census of every optimizer group


def _grouped_step(opt, groups):
    """DeepSpeed ZeRO-1/2's step (stage_1_and_2._optimizer_step): each group alone swapped in, then stepped."""
    original = opt.param_groups
    for g in groups:
        opt.param_groups = [g]
        opt.step()
    opt.param_groups = original


def _census_of_grouped_steps(calls_per_step: int) -> int:
    dense, experts = torch.zeros(300, requires_grad=True), torch.zeros(500, requires_grad=True)
    opt = torch.optim.AdamW([{"params": [dense]}, {"params": [experts]}], lr=1e-3)
    census = CensusAtStep(opt, lambda: {"optimizer_states": optimizer_state_tensors(opt)}, calls_per_step)
    for _ in range(2):
        dense.grad, experts.grad = torch.ones(300), torch.ones(500)
        _grouped_step(opt, list(opt.param_groups))
    return census.result["optimizer_states"]["fp32"]


def test_census_counts_every_group_a_grouped_step_steps():
    """A dense group and an expert group stepped one at a time (DeepSpeed's MoE under ZeRO): AdamW's two
    fp32 moments of both groups are in the census, plus one fp32 step counter a group. Counted after the
    first call alone (what DeepSpeed's census did: 0.33P at dp4 ep2), the expert group's are missing."""
    assert _census_of_grouped_steps(2) == 2 * 800 * 4 + 2 * 4
    assert _census_of_grouped_steps(1) == 2 * 300 * 4 + 4


# ------------------------------------------------------------------ N, P and the FLOP convention


def test_report_defines_n_and_p_and_the_convention_terms():
    moe = {"workload": {"model": "tiny-moe", "seq_len": 32}, "runs": []}
    text = " ".join(flop_text(moe))
    assert "6N + 12·L·h·s = 6 x 132,416 + 12 x 2 x 64 x 32 = 843,648" in text
    assert "census's P = 353,600" in text and "no causal halving" in text and "input embedding" in text
    assert "P = 353,600: every parameter of the model, all experts." in census_text(moe)
    dense = " ".join(flop_text({"workload": {"model": "tiny", "seq_len": 64}, "runs": []}))
    assert "N = P = 125,248" in dense
    assert flop_text({"runs": []}) == []  # no workload: nothing said


# ------------------------------------------------------------------ final weights


def test_weights_fingerprint_tells_weights_apart_by_their_relative_difference():
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(64, 64, generator=g), "b.weight": torch.randn(64, generator=g)}
    same = weights_fingerprint({k: v.clone() for k, v in state.items()})
    assert fingerprint_rel_diff(same, weights_fingerprint(state)) == (0.0, None)
    scaled = weights_fingerprint({**state, "b.weight": state["b.weight"] * (1 + 1e-4)})  # the norm moves by 1e-4
    worst, at = fingerprint_rel_diff(scaled, weights_fingerprint(state))
    assert at == "b.weight" and worst == pytest.approx(1e-4, rel=1e-2)  # float32 rounding of the scaling
    assert fingerprint_rel_diff({"a.weight": [1.0, 0.0]}, same)[0] == float("inf")  # a parameter missing


def test_parity_compares_final_weights_and_says_why_a_run_has_none():
    fp = {"w": [2.0, 0.5]}
    runs = _runs(NORMS)
    runs[0]["metrics"] = {"weights_fingerprint": fp}
    runs[1]["metrics"] = {"weights_fingerprint": {"w": [2.0 * (1 + 1e-3), 0.5]}}
    runs[2]["metrics"]["weights_fingerprint"] = "not gathered: 7,000,000,000 parameters (> 200,000,000) on one rank"
    p = check_parity(runs, 4, 1e-5)
    b = next(r for r in p["runs"] if r["label"] == "b")
    assert b["verdict"] == FAIL and "final weights: w differs by 1.0e-03" in b["note"]
    assert p["weights"]["compared"] == ["ref", "b"] and "not gathered" in p["weights"]["not_compared"]["c"]
    text = "; ".join(reasons({"parity": p, "runs": [], "fingerprints": {"same": True}}))
    assert "final weights DIFFER for 2 run(s)" in text and "c: not gathered" in text
