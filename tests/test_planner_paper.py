"""The planner against the reference study's four published sweeps (in-repo copies).

Data: baselines/paper_sweeps (Hagemann et al. 2023, arXiv 2311.05610, CC BY-NC-SA 4.0).
In-sample targets: on the sweeps together OOM accuracy >= 0.96; measured-best layout
in the top 3 predicted-to-fit in every sweep; median MFU error <= 2 points (read over all finished
runs together; the stricter per-sweep reading is reported too); its in-sample mean Spearman >= 0.92
is withdrawn. The targets for runs not seen are asserted on the held-out figures below.
Figures: in-sample (the shipped a100-80gb profile, whose efficiency constants were fitted on all
four sweeps), leave-one-sweep-out (constants refitted on three sweeps, the fourth scored) and
leave-one-model-out (fitted on the other model's two sweeps). Memory has no fitted part, so its
OOM figure is the same in all of them.
Print them with:  python -m pytest -q -s tests/test_planner_paper.py
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from harness.planner import paper
from harness.planner.hardware import load_profile


@functools.cache
def in_sample():
    return paper.figures(load_profile("a100-80gb"))


@functools.cache
def loso():
    return paper.leave_one_sweep_out(load_profile("a100-80gb"))


@functools.cache
def lomo():
    return paper.leave_one_model_out(load_profile("a100-80gb"))


def _line(f: dict) -> str:
    return (
        f"oom_accuracy {f['oom_accuracy']:.3f} spearman {f['spearman']:.3f} "
        f"best_rank {f['best_rank']} median_mfu_error {f['median_mfu_error_points']:.2f} pts"
    )


def test_the_four_sweeps_are_in_the_repo():
    assert len(paper.repo_sweeps()) == 4
    assert sum(len(paper.load_sweep(p)) for p in paper.repo_sweeps()) == 410


def _assert_sane(figs: dict) -> None:
    """Every printed figure is a number in its range: accuracy a fraction, a positive rank
    correlation (a planner ranking backwards is broken, not imprecise), the measured-best layout
    predicted to fit, an MFU error of a few points."""
    assert len(figs) == 4
    for f in figs.values():
        assert 0 <= f["oom_accuracy"] <= 1
        assert 0 < f["spearman"] <= 1  # also false for nan
        assert isinstance(f["best_rank"], int) and f["best_rank"] >= 1
        assert 0 <= f["median_mfu_error_points"] < 10
    s = paper.summary(figs)
    assert all(np.isfinite(v) for k, v in s.items() if k != "best_in_top3_all")


def test_print_figures():
    for tag, figs in (("in-sample", in_sample()), ("leave-one-sweep-out", loso()), ("leave-one-model-out", lomo())):
        print(f"\n{tag}: {paper.summary(figs)}")
        for name, f in figs.items():
            print(f"  {name}: {_line(f)}")
        _assert_sane(figs)


def test_print_per_sweep_fit_bound():
    """Constants fitted on each sweep alone (forbidden tuning, not a prediction): what calibration
    can reach with this time model. Where this too misses a target, calibration cannot close the
    gap; only new structure can (0.916 mean Spearman today, 0.900 before the allocator-pressure
    cost per step of timing.py)."""
    figs = paper.per_sweep_fits(load_profile("a100-80gb"))
    print(f"\nper-sweep fits (what calibration can reach): {paper.summary(figs)}")
    for name, f in figs.items():
        print(f"  {name}: {_line(f)}")
    _assert_sane(figs)
    # Fitting each sweep alone must not rank clearly worse on average than one fit shared by all
    # four. Not exactly: a least-squares fit of one sweep's step times is not a fit of its ranks,
    # and with the allocator-pressure constant (fitted 3.5 to 6.4 s on each sweep alone, 8.7 on all
    # four) 30B-64 alone ranks 0.929 against 0.956 with the shared constants (0.916 against 0.918
    # on average).
    assert paper.summary(figs)["mean_spearman"] >= paper.summary(in_sample())["mean_spearman"] - 0.01


def test_print_per_token_and_per_step_parts():
    """The same layouts on 2x / 4x the GPUs: what scales with tokens per GPU and what does not."""
    rows = paper.token_and_step_parts(load_profile("a100-80gb"))
    assert len(rows) >= 15
    print("\nper-token part C and per-step constant D (seconds on the larger sweep), measured | predicted")
    for row in rows:
        lay = row["layout"]
        print(
            f"  {row['pair'].split('_')[1]} tp{lay.tp} pp{lay.pp} dp{lay.dp:3d} mb{lay.micro_batch_size} "
            f"sp{int(lay.sequence_parallel)}: C {row['per_token_s']:6.2f} D {row['per_step_s']:6.2f} | "
            f"C {row['per_token_pred_s']:6.2f} D {row['per_step_pred_s']:6.2f}"
        )
    # The per-token part is what the planner gets right: within 10% on every pair.
    assert all(abs(r["per_token_pred_s"] - r["per_token_s"]) <= 0.1 * r["per_token_s"] for r in rows)


def test_regression_guards():
    """What the model reaches today (in-sample and leave-one-sweep-out); not the acceptance."""
    for figs in (in_sample(), loso()):
        s = paper.summary(figs)
        assert s["oom_accuracy"] >= 0.96
        assert s["mean_spearman"] >= 0.90
        assert s["max_median_mfu_error_points"] <= 2.3


def test_regression_guard_unmeasured_model():
    """Calibrated on one model, predicting the other (0.883 mean Spearman today, best layout
    predicted 1st, 1st, 1st, 2nd): the case of a model nobody has measured yet."""
    s = paper.summary(lomo())
    assert s["best_in_top3_all"]
    assert s["mean_spearman"] >= 0.87
    assert s["median_mfu_error_points"] <= 1.8


def test_acceptance_oom_accuracy_together():
    """Met: 0.967 (377 of 390 judged runs), in-sample and leave-one-sweep-out alike (memory has
    no fitted per-sweep part)."""
    assert paper.summary(in_sample())["oom_accuracy"] >= 0.96
    assert paper.summary(loso())["oom_accuracy"] >= 0.96


def test_acceptance_best_in_top3():
    """Met: the measured-best layout is predicted 1st, 1st, 1st, 2nd in-sample and 1st in all four
    sweeps leave-one-sweep-out."""
    assert all(f["best_in_top3"] for f in in_sample().values())
    assert all(f["best_in_top3"] for f in loso().values())


def test_acceptance_median_mfu_error():
    """Met over all 192 finished runs together: 1.38 points in-sample, 1.66 leave-one-sweep-out."""
    assert paper.summary(in_sample())["median_mfu_error_points"] <= 2.0
    assert paper.summary(loso())["median_mfu_error_points"] <= 2.0


@pytest.mark.xfail(
    reason="stricter per-sweep reading, not met in 13B-32: in-sample 2.19/1.97/1.22/1.15 "
    "points, leave-one-sweep-out 2.21/1.95/1.47/1.21 (13B-32, 13B-64, 30B-256, 30B-64)",
    strict=True,
)
def test_median_mfu_error_per_sweep():
    assert all(f["median_mfu_error_points"] <= 2.0 for f in in_sample().values())
    assert all(f["median_mfu_error_points"] <= 2.0 for f in loso().values())


# ---------------------------------------------------------------- runs the planner has not seen
# Targets on runs the planner has not seen: OOM accuracy >= 0.96, mean Spearman >= 0.94, the
# measured-best layout in the predicted top 3 of every sweep, median MFU error <= 1.5 points. The
# in-sample Spearman target (>= 0.92) is withdrawn; what is asserted here is the held-out
# figures on the four sweeps we have (by sweep and by model), met or honestly marked not met.


def test_allocator_pressure_costs_per_step_above_the_threshold():
    """The caching allocator's flushes near a full device (timing.ALLOC_PRESSURE_*): nothing below
    the threshold, a cost per step growing with the predicted peak above it (capped at a full
    device), its constant calibrated with the efficiencies and read back from the profile."""
    from harness.model.presets import PRESETS
    from harness.planner import timing
    from harness.planner.layout import PlannerLayout, Workload
    from harness.planner.memory import GIB

    prof = load_profile("a100-80gb")
    shape, lay, wl = PRESETS["paper-13b"], PlannerLayout(2, 2, 8, 1), Workload(2048, 2048)
    cap = prof.memory_gib * GIB
    pressure = [timing.alloc_pressure(shape, lay, wl, prof, f * cap) for f in (0.3, 0.65, 0.8, 0.95, 1.0, 1.3)]
    assert pressure[:2] == [0.0, 0.0]
    assert 0 < pressure[2] < pressure[3] < pressure[4] == pressure[5] == pytest.approx(1 - timing.ALLOC_PRESSURE_FROM)
    theta = timing.theta_from_profile(prof)
    assert theta["alloc_pressure_s"] == prof.calibrated["alloc_pressure_s"] > 0
    low, _ = timing.step_time(shape, lay, wl, prof, theta, memory_bytes=0.5 * cap)
    high, parts = timing.step_time(shape, lay, wl, prof, theta, memory_bytes=0.95 * cap)
    assert high - low == pytest.approx(parts["allocator_pressure_s"]) and parts[
        "allocator_pressure_s"
    ] == pytest.approx(theta["alloc_pressure_s"] * (0.95 - timing.ALLOC_PRESSURE_FROM))
    # Per step: the same cost at 4x the tokens per step.
    _, parts4 = timing.step_time(shape, lay, Workload(2048, 8192), prof, theta, memory_bytes=0.95 * cap)
    assert parts4["allocator_pressure_s"] == pytest.approx(parts["allocator_pressure_s"])
    # step_features (what calibration fits) carries it as its own feature, in step_time's sum.
    feats, _ = timing.step_features(shape, lay, wl, prof, theta, memory_bytes=0.95 * cap)
    assert feats["alloc_pressure_s"] == pytest.approx(0.95 - timing.ALLOC_PRESSURE_FROM)
    assert sum(theta[k] * v for k, v in feats.items()) == pytest.approx(high, rel=1e-9)


def test_oom_accuracy_held_out():
    """Met: 0.967 by sweep and by model (377 of 390)."""
    assert paper.summary(loso())["oom_accuracy"] >= 0.96
    assert paper.summary(lomo())["oom_accuracy"] >= 0.96


def test_best_in_top3_held_out():
    """Met: predicted 1st in every sweep by sweep; 1st, 1st, 1st, 2nd by model."""
    assert all(f["best_in_top3"] for f in loso().values())
    assert all(f["best_in_top3"] for f in lomo().values())


@pytest.mark.xfail(
    reason="not met: mean Spearman 0.907 leave-one-sweep-out (0.870/0.913/0.888/0.958), "
    "0.883 leave-one-model-out (0.822/0.911/0.881/0.918) for 13B-32, 13B-64, 30B-256, "
    "30B-64; even per-sweep fits reach only 0.916",
    strict=True,
)
def test_spearman_held_out():
    assert paper.summary(loso())["mean_spearman"] >= 0.94
    assert paper.summary(lomo())["mean_spearman"] >= 0.94


@pytest.mark.xfail(
    reason="not met: median MFU error 1.66 points leave-one-sweep-out, 1.62 leave-one-model-out (1.38 in-sample)",
    strict=True,
)
def test_median_mfu_error_held_out():
    assert paper.summary(loso())["median_mfu_error_points"] <= 1.5
    assert paper.summary(lomo())["median_mfu_error_points"] <= 1.5


# No sweep at sequence 8192 or of 65B is in the repository; the held-aside ones were
# under-predicted in memory and, for FlashAttention-2, in MFU. These check that the terms added
# for it move the predictions the physically right way, and only where they should.


def _pred(model, seq, gbs, **kw):
    from harness.model.presets import PRESETS
    from harness.planner.layout import PlannerLayout, Workload
    from harness.planner.predict import predict

    base = dict(
        tp=2, pp=4, dp=16, micro_batch_size=1, activation_checkpointing="full", attention="flash2", rmsnorm="fused"
    )
    return predict(PRESETS[model], PlannerLayout(**{**base, **kw}), Workload(seq, gbs), load_profile("a100-80gb"))


def test_memory_terms_grow_with_model_size_and_sequence(monkeypatch):
    from harness.model.presets import PRESETS
    from harness.planner import memory_paper

    # The all-reduce bucket closes only after crossing 5e8 elements: with the 128k x 8192 LM head
    # (1.05e9 elements at tp=1) a 65B bucket holds more than 5e8 plus the head's gradient.
    s65, s13 = PRESETS["paper-65b"], PRESETS["paper-13b"]
    head65 = s65.vocab * s65.hidden
    assert memory_paper.paper_allreduce_bucket_elements(s65, False, 20, True, 1) > head65
    assert memory_paper.paper_allreduce_bucket_elements(s65, False, 20, True, 1) <= 5e8 + head65
    assert memory_paper.paper_allreduce_bucket_elements(
        s65, False, 20, True, 1
    ) > memory_paper.paper_allreduce_bucket_elements(s13, False, 20, True, 1)
    # The stranded fp32 logits block is 4x larger at 8192 than at 2048 tokens per sequence.
    from harness.planner.layout import PlannerLayout, Workload

    lay = PlannerLayout(2, 4, 16, 1)
    assert memory_paper.paper_stranded_block(
        s13, lay, Workload(8192, 512), True
    ) == 4 * memory_paper.paper_stranded_block(s13, lay, Workload(2048, 2048), True)
    # Switched off, the pipelined 65B and 8192-token layouts need less memory: the terms add to both.
    cases = {("paper-65b", 2048, 2048): dict(tp=8, pp=2, dp=8, micro_batch_size=2), ("paper-13b", 8192, 512): {}}
    with_terms = {k: _pred(*k, **kw).memory_gib for k, kw in cases.items()}
    monkeypatch.setattr(memory_paper, "STRANDED_BLOCKS", 0.0)
    for k, kw in cases.items():
        assert with_terms[k] > _pred(*k, **kw).memory_gib + 0.5
    # Not pipelined, micro-batches free their tensors in reverse order: no stranded block.
    assert _pred("paper-13b", 8192, 512, pp=1, dp=64).memory_gib == pytest.approx(
        _pred("paper-13b", 8192, 512, pp=1, dp=64).memory_gib
    )


def test_flash2_gains_more_than_flash1_at_long_sequences():
    from harness.planner import timing

    def ratio(seq, gbs):
        return _pred("paper-13b", seq, gbs).step_time_s / _pred("paper-13b", seq, gbs, attention="flash1").step_time_s

    # FlashAttention-2 is the faster kernel, and attention is 4x the share of a step at 8192 tokens:
    # its advantage over FlashAttention-1 grows with the sequence.
    assert ratio(8192, 512) < ratio(2048, 2048) < 1.0
    # The flash rate grows with the sequence: at 4x the tokens per sequence the attention work per
    # token is 4x, its time per token less than that (about 3.4x).
    from harness.model.presets import PRESETS
    from harness.planner.layout import PlannerLayout, Workload

    lay = PlannerLayout(4, 1, 32, 1, attention="flash2")
    prof = load_profile("a100-80gb")
    per_token = {
        seq: timing.stage_features(PRESETS["paper-13b"], lay, Workload(seq, 2048 * 2048 // seq), prof, 0)["flash2"]
        / seq
        for seq in (2048, 8192)
    }
    assert 3.0 < per_token[8192] / per_token[2048] < 3.6
