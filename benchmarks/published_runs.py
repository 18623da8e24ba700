"""The planner against published GPU training runs (baselines/published_runs/runs.csv).

For every row the planner can express: the predicted tokens/s per GPU at the row's own layout
with the committed profile (its `calibrated` block, fitted to these rows: in-sample), and with the
profile refitted on the other rows of its device only (leave-one-row-out: the row never seen), the
error of each against the published figure; the predicted peak memory of the worst stage against
the peak the source publishes (torchtitan, torchao) and whether it fits the device. A row that trained
but is predicted not to fit, or whose published peak is missed by more than 10%, prints what the
planner lacks (the data's `unmodelled` column). Rows the planner cannot express say why. Last lines:
the median |error| of each kind, and the memory targets (every published peak within 10%, at least 90%
of the planned rows that trained predicted to fit).

    python benchmarks/published_runs.py [--csv FILE] [--no-held-out]
"""

from __future__ import annotations

import argparse
import copy
import statistics

from harness.planner.calibrate import Sample, fit
from harness.planner.hardware import load_profile
from harness.planner.predict import predict
from harness.planner.published import RUNS_CSV, load, memory_check, unmodelled


def literature(profile):
    """The profile without its calibrated block: the prior every refit starts from."""
    base = copy.deepcopy(profile)
    base.calibrated = {}
    return base


def sample(run) -> Sample:
    return Sample(run.shape, run.layout, run.workload, run.step_time_s, run.label, profile=run.profile)


def held_out(runs, run) -> float:
    """Tokens/s per GPU predicted for `run` by its device's profile fitted to the other rows."""
    others = [sample(r) for r in runs if r is not run and r.profile.name == run.profile.name]
    if not others:
        return float("nan")
    prof, _ = fit(others, literature(load_profile(run.profile.name)))
    prof = copy.deepcopy(prof)
    prof.memory_gib = run.profile.memory_gib
    return predict(run.shape, run.layout, run.workload, prof).tokens_per_s / run.layout.gpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default=str(RUNS_CSV))
    ap.add_argument("--no-held-out", action="store_true", help="skip the leave-one-row-out refits")
    args = ap.parse_args()
    runs = load(args.csv)
    planned = [r for r in runs if not r.why_not]
    errors, held = [], []
    print(
        f"{'row':88} {'published':>9} {'predicted':>9} {'error':>7} {'held out':>9} {'error':>7} "
        f"{'GiB':>6} {'device':>6} {'peak':>6} {'error':>7} fits"
    )
    checks = []
    for run in runs:
        if run.why_not:
            print(f"{run.label:88} {run.tokens_per_s_per_gpu:9.0f}  not planned: {run.why_not}")
            if run.layout is not None:  # expressed, checked apart (the mixture of experts): its memory all the same
                m = memory_check(run)
                print(f"    memory {m.predicted_gib:.1f} GiB on {m.device_gib:.1f}: fits {'yes' if m.fits else 'NO'}")
                if not m.fits:
                    print(f"    unmodelled: {unmodelled(run) or '(none named)'}")
            continue
        p = predict(run.shape, run.layout, run.workload, run.profile)
        tok = p.tokens_per_s / run.layout.gpus
        err = tok / run.tokens_per_s_per_gpu - 1
        errors.append(abs(err))
        line = f"{run.label:88} {run.tokens_per_s_per_gpu:9.0f} {tok:9.0f} {100 * err:+6.1f}%"
        if not args.no_held_out:
            tok_h = held_out(planned, run)
            err_h = tok_h / run.tokens_per_s_per_gpu - 1
            if err_h == err_h:
                held.append(abs(err_h))
            line += f" {tok_h:9.0f} {100 * err_h:+6.1f}%"
        m = memory_check(run)
        checks.append(m)
        peak = f"{m.published_gib:6.1f} {100 * m.error:+6.1f}%" if m.published_gib else f"{'':6} {'':7}"
        print(f"{line} {m.predicted_gib:6.1f} {m.device_gib:6.1f} {peak} {'yes' if m.fits else 'NO'}")
        if not m.fits or (m.error is not None and abs(m.error) > 0.10):
            print(f"    unmodelled: {unmodelled(run) or '(none named)'}")
    print(f"rows planned: {len(planned)} of {len(runs)}")
    med = 100 * statistics.median(errors)
    print(f"median |error|, committed profiles (fitted to these rows; h200 takes h100-sxm's, checked): {med:.1f}%")
    if held:
        print(f"median |error|, each row held out of its profile's fit: {100 * statistics.median(held):.1f}%")
    peaks = [m for m in checks if m.error is not None]
    within = sum(abs(m.error) <= 0.10 for m in peaks)
    fit = sum(m.fits for m in checks)
    print(f"published peaks predicted within 10%: {within} of {len(peaks)}")
    print(f"rows that trained predicted to fit: {fit} of {len(checks)} ({100 * fit / len(checks):.0f}%)")


if __name__ == "__main__":
    main()
