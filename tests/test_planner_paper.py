"""The planner against the reference study's four published sweeps (in-repo copies).

Data: baselines/paper_sweeps (Hagemann et al. 2023, arXiv 2311.05610, CC BY-NC-SA 4.0).
The issue's acceptance: on the sweeps together OOM accuracy >= 0.96; mean per-sweep Spearman
>= 0.92; measured-best layout in the top 3 predicted-to-fit in every sweep; median MFU error <= 2
points (read over all finished runs together; the stricter per-sweep reading is reported too).
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
    return (f"oom_accuracy {f['oom_accuracy']:.3f} spearman {f['spearman']:.3f} "
            f"best_rank {f['best_rank']} median_mfu_error {f['median_mfu_error_points']:.2f} pts")


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
    for tag, figs in (("in-sample", in_sample()), ("leave-one-sweep-out", loso()),
                      ("leave-one-model-out", lomo())):
        print(f"\n{tag}: {paper.summary(figs)}")
        for name, f in figs.items():
            print(f"  {name}: {_line(f)}")
        _assert_sane(figs)


def test_print_per_sweep_fit_bound():
    """Constants fitted on each sweep alone (forbidden tuning, not a prediction): what calibration
    can reach with this time model. Where this too misses a target, calibration cannot close the
    gap; only new structure can (0.903 mean Spearman today)."""
    figs = paper.per_sweep_fits(load_profile("a100-80gb"))
    print(f"\nper-sweep fits (what calibration can reach): {paper.summary(figs)}")
    for name, f in figs.items():
        print(f"  {name}: {_line(f)}")
    _assert_sane(figs)
    # Fitting each sweep alone must not rank worse on average than one fit shared by all four.
    assert paper.summary(figs)["mean_spearman"] >= paper.summary(in_sample())["mean_spearman"]


def test_print_per_token_and_per_step_parts():
    """The same layouts on 2x / 4x the GPUs: what scales with tokens per GPU and what does not."""
    rows = paper.token_and_step_parts(load_profile("a100-80gb"))
    assert len(rows) >= 15
    print("\nper-token part C and per-step constant D (seconds on the larger sweep), measured | predicted")
    for row in rows:
        lay = row["layout"]
        print(f"  {row['pair'].split('_')[1]} tp{lay.tp} pp{lay.pp} dp{lay.dp:3d} mb{lay.micro_batch_size} "
              f"sp{int(lay.sequence_parallel)}: C {row['per_token_s']:6.2f} D {row['per_step_s']:6.2f} | "
              f"C {row['per_token_pred_s']:6.2f} D {row['per_step_pred_s']:6.2f}")
    # The per-token part is what the planner gets right: within 10% on every pair.
    assert all(abs(r["per_token_pred_s"] - r["per_token_s"]) <= 0.1 * r["per_token_s"] for r in rows)


def test_regression_guards():
    """What the model reaches today (in-sample and leave-one-sweep-out); not the acceptance."""
    for figs in (in_sample(), loso()):
        s = paper.summary(figs)
        assert s["oom_accuracy"] >= 0.96
        assert s["mean_spearman"] >= 0.87
        assert s["max_median_mfu_error_points"] <= 2.3


def test_regression_guard_unmeasured_model():
    """Calibrated on one model, predicting the other (0.868 mean Spearman today, best layout
    predicted first in all four sweeps): the case of a model nobody has measured yet."""
    s = paper.summary(lomo())
    assert s["best_in_top3_all"]
    assert s["mean_spearman"] >= 0.85
    assert s["median_mfu_error_points"] <= 2.0


def test_acceptance_oom_accuracy_together():
    """Met: 0.964 (376 of 390 judged runs), in-sample and leave-one-sweep-out alike (memory has
    no fitted per-sweep part)."""
    assert paper.summary(in_sample())["oom_accuracy"] >= 0.96
    assert paper.summary(loso())["oom_accuracy"] >= 0.96


@pytest.mark.xfail(reason="not met: mean Spearman 0.891 in-sample, 0.879 leave-one-sweep-out "
                          "(0.80/0.91/0.91/0.94 and 0.80/0.91/0.86/0.94 for 13B-32, 13B-64, 30B-256, 30B-64)",
                   strict=True)
def test_acceptance_spearman():
    assert paper.summary(in_sample())["mean_spearman"] >= 0.92
    assert paper.summary(loso())["mean_spearman"] >= 0.92


def test_acceptance_best_in_top3():
    """Met: the measured-best layout is predicted 1st, 1st, 2nd, 1st in-sample and 1st in all four
    sweeps leave-one-sweep-out."""
    assert all(f["best_in_top3"] for f in in_sample().values())
    assert all(f["best_in_top3"] for f in loso().values())


def test_acceptance_median_mfu_error():
    """Met over all 192 finished runs together: 1.44 points in-sample, 1.76 leave-one-sweep-out."""
    assert paper.summary(in_sample())["median_mfu_error_points"] <= 2.0
    assert paper.summary(loso())["median_mfu_error_points"] <= 2.0


@pytest.mark.xfail(reason="stricter per-sweep reading, not met in two sweeps: in-sample 2.05/2.07/1.24/0.79 "
                          "points, leave-one-sweep-out 2.22/1.90/1.75/0.88 (13B-32, 13B-64, 30B-256, 30B-64)",
                   strict=True)
def test_median_mfu_error_per_sweep():
    assert all(f["median_mfu_error_points"] <= 2.0 for f in in_sample().values())
    assert all(f["median_mfu_error_points"] <= 2.0 for f in loso().values())
