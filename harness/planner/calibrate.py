"""Fit a profile's efficiency constants to measured step times.

The step time is linear in the inverse efficiencies (timing.py), so the fit is least squares on
relative errors, with a weak pull towards the profile's literature values (so a constant the
measurements say nothing about keeps its value) and efficiencies capped at 1 (no work runs above
its datasheet peak). Which stage is slowest and how much data-parallel reduction hides depend on
the constants, so the fit repeats a few times. Nothing is fitted per row or per sweep.
"""

from __future__ import annotations

import copy
import os
import sqlite3
from dataclasses import dataclass

import numpy as np

from harness.errors import SpecError
from harness.model.presets import Shape, resolve_shape
from harness.planner.features import EXTRA_KEYS, theta_from_profile
from harness.planner.hardware import EFFICIENCY_KEYS, Profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.memory import worst_stage_memory
from harness.planner.timing import step_features
from harness.spec.schema import BF16_PRECISIONS
from harness.store import ResultsStore, check_store

RIDGE = 0.01  # weight of the pull towards the literature value, per constant (relative)
# Constants held near their literature value more firmly than RIDGE (multipliers of it): the flash
# kernels' rates. At 2048 tokens flash attention is ~5% of a step, so the published sweeps leave
# them unidentified: fitting flash2 anywhere from 0.17 to 0.53 of peak moves the fit's median
# step-time error only between 3.6% and 3.9% and no rank figure. With the weak prior the fit let
# them absorb other residuals (flash2 0.31, at FlashAttention-1's rate, against the measured
# 50-70% on A100 in Dao 2023, Fig. 4), while attention is 4x the share of a step at 8192 tokens,
# consistent with the held-aside sequence-8192 sweeps coming out 3-6 MFU points low for
# FlashAttention-2. At 10x the pull, flash2 fits at 0.46 and flash1 at 0.34 of peak,
# for the same figures on the four published sweeps (mean Spearman within 0.001; median MFU error
# +0.02 points in-sample, -0.09 held out by sweep, +0.01 by model: tests/test_planner_paper.py).
PRIOR_WEIGHT: dict[str, float] = {"flash2": 10.0, "flash1": 10.0}
MIN_SHARE = 0.01  # a constant is fitted only if its work is >= 1% of some measured step
ITERATIONS = 4


@dataclass
class Sample:
    shape: Shape
    layout: PlannerLayout
    workload: Workload
    step_time_s: float
    label: str = ""
    profile: Profile | None = None  # the sample's own device, where it differs from the fitted profile's (memory)


def _theta_to_eff(theta: dict) -> dict:
    """The profile's efficiencies from theta (the extra constants, in seconds, are not efficiencies)."""
    return {k: (v if k == "launch_us" else 1.0 / v) for k, v in theta.items() if k in EFFICIENCY_KEYS}


def fit(samples: list[Sample], base: Profile, label: str = "") -> tuple[Profile, dict]:
    """A copy of `base` with a `calibrated` block, and a report of the fit error."""
    if not samples:
        raise SpecError("--calibrate", "no successful runs with a step time to calibrate on")
    keys = list(EFFICIENCY_KEYS) + list(EXTRA_KEYS)  # the extras: seconds, floor 0 (timing.py)
    literature = copy.deepcopy(base)
    literature.calibrated = {}  # the prior is the literature values, not an earlier calibration
    theta0 = theta_from_profile(literature)
    theta = dict(theta0)
    y_obs = np.array([s.step_time_s for s in samples])
    memory = [None] * len(samples)  # each sample's predicted peak, computed once (allocator pressure)
    for _ in range(ITERATIONS):
        rows = []
        for i, s in enumerate(samples):
            if memory[i] is None:
                memory[i] = worst_stage_memory(s.shape, s.layout, s.workload)[1]["total"]
            f = step_features(s.shape, s.layout, s.workload, s.profile or base, theta, memory_bytes=memory[i])[0]
            rows.append([f[k] for k in keys])
        X = np.array(rows)
        share = (X * np.array([theta[k] for k in keys])) / y_obs[:, None]
        free = [i for i, k in enumerate(keys) if share[:, i].max() >= MIN_SHARE]
        fixed = [i for i in range(len(keys)) if i not in free]
        while free:
            A = X[:, free] / y_obs[:, None]
            rhs = 1.0 - (X[:, fixed] @ np.array([theta[keys[i]] for i in fixed])) / y_obs
            prior = np.array([theta0[keys[i]] for i in free])
            w = np.sqrt(np.array([RIDGE * PRIOR_WEIGHT.get(keys[i], 1.0) for i in free]))
            A = np.vstack([A, np.diag(w / prior)])
            rhs = np.concatenate([rhs, w])
            sol = np.linalg.lstsq(A, rhs, rcond=None)[0]
            floor = np.array([0.0 if keys[i] == "launch_us" or keys[i] in EXTRA_KEYS else 1.0 for i in free])
            low = sol < floor
            if not low.any():
                break
            for j in np.flatnonzero(low)[::-1]:  # pin at the bound, refit the rest
                theta[keys[free[j]]] = floor[j]
                fixed.append(free.pop(j))
        for i, value in zip(free, sol if free else [], strict=False):
            theta[keys[i]] = float(value)
    pred = np.array(
        [
            sum(
                theta[k] * v
                for k, v in step_features(s.shape, s.layout, s.workload, s.profile or base, theta, memory_bytes=mem)[
                    0
                ].items()
            )
            for s, mem in zip(samples, memory, strict=False)
        ]
    )
    rel = (pred - y_obs) / y_obs
    eff = _theta_to_eff(theta)
    report = {
        "samples": len(samples),
        "fitted": [keys[i] for i in free],
        "median_abs_error_pct": float(np.median(np.abs(rel)) * 100),
        "mean_abs_error_pct": float(np.mean(np.abs(rel)) * 100),
        "max_abs_error_pct": float(np.max(np.abs(rel)) * 100),
        "efficiency": {k: round(v, 4) for k, v in eff.items()},
        **{k: round(float(theta[k]), 4) for k in EXTRA_KEYS},
    }
    prof = copy.deepcopy(base)
    prof.calibrated = {
        "efficiency": {k: round(float(eff[k]), 5) for k in EFFICIENCY_KEYS},
        **{k: round(float(theta[k]), 5) for k in EXTRA_KEYS},
        "fitted": report["fitted"],
        "fitted_on": label or f"{len(samples)} runs",
        "samples": len(samples),
        "median_abs_error_pct": round(report["median_abs_error_pct"], 2),
    }
    prof.name = base.name + "-calibrated"
    return prof, report


# ---------------------------------------------------------------- harness records


def sample_from_record(rec: dict) -> Sample | None:
    """A Sample from one results-store record (schema_version 1), or None if it has no time."""
    if rec.get("status") != "ok":
        return None
    try:
        wl = rec["spec"]["workload"]
        lay = rec["spec"]["layout"]
        t = rec["metrics"]["step_time_s"]["median"]
    except (KeyError, TypeError):
        return None
    if not t:
        return None
    shape = resolve_shape(wl["model"], wl.get("model_overrides") or None)
    layout = PlannerLayout.from_spec(lay, wl.get("precision", "fp32"))
    workload = Workload(
        int(wl["seq_len"]), int(wl["global_batch_size"]), 2 if wl.get("precision") in BF16_PRECISIONS else 4
    )
    return Sample(shape, layout, workload, float(t), rec.get("run_id", ""))


def calibrate_from_records(records: list[dict], base_profile: Profile) -> tuple[Profile, dict]:
    """Fit `base_profile`'s efficiencies to harness run records (dicts as the store keeps them)."""
    samples = [s for s in (sample_from_record(r) for r in records) if s is not None]
    return fit(samples, base_profile, label=f"{len(samples)} harness runs")


def read_store(path: str) -> list[dict]:
    """The successful records of a results store (the only ones calibration uses)."""
    if not os.path.exists(path):
        raise SpecError("--calibrate", f"results store {path!r} does not exist")
    check_store(path, write=False)  # a directory, a foreign or a newer store: one `error: store:` line
    try:
        return ResultsStore(path).records(status="ok")
    except sqlite3.Error as e:
        raise SpecError("--calibrate", f"cannot read runs from {path!r}: {e}") from None
