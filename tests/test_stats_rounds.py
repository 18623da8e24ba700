"""Load drift between a comparison's runs: runs launched in alternating rounds are
compared round by round, so a load that changes between rounds does not decide; by default the first
run is measured again after the last, and a drift it finds widens every pair's interval. Stand-in
launches (no process starts) on a machine whose speed the test sets per launch."""

from __future__ import annotations

import math
import random

from harness.compare.orchestrate import run_comparison
from harness.compare.spec import parse_compare_spec
from harness.measure.stats import compare_times, verdict_text
from harness.report.compare_steps import why_section
from harness.report.drift import load_drift_factor
from harness.testing.workloads import tiny_workload

STEP_MS = {"own dp2": 20.0, "own dp2 mb1": 20.0, "own dp2 recompute": 26.0}  # the runs' speed on an idle machine


def launcher(load):
    """A stand-in for launch.run_spec: 12 steps at the run's speed times load(launch index, point key)."""
    calls = []
    rng = random.Random(11)

    def launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        calls.append((point_key, sweep))
        base = STEP_MS.get(point_key.removesuffix(" (load drift check)"), 30.0) * load(len(calls) - 1, point_key)
        times = [base / 1e3 * math.exp(rng.gauss(0, 0.02)) for _ in range(12)]
        median = sorted(times)[6]
        return {
            "run_id": f"id-{len(calls)}",
            "status": "ok",
            "spec": spec,
            "metrics": {
                "losses": [5.0, 4.9, 4.8],
                "step_times_s": times,
                "step_time_s": {"median": median, "ci95_low": min(times), "ci95_high": max(times), "n": 12},
                "tokens_per_step": 512,
                "tokens_per_s": 512 / median,
                "breakdown_measured_ms": {"compute": 1e3 * median, "exposed_comm": {}, "step": 1e3 * median},
            },
        }

    return launch, calls


def _spec():
    runs = [
        {"label": "own dp2", "engine": "own", "dp": 2, "micro_batch_size": 2},
        {"label": "own dp2 mb1", "engine": "own", "dp": 2, "micro_batch_size": 1},
        {
            "label": "own dp2 recompute",
            "engine": "own",
            "dp": 2,
            "micro_batch_size": 2,
            "activation_checkpointing": "full",
        },
    ]
    return parse_compare_spec(
        {"name": "t", "nproc": 2, "parity_steps": 3, "workload": tiny_workload(steps=3, warmup_steps=1), "runs": runs}
    )


def _why(summary) -> str:
    return "\n".join(str(x) for b in why_section(summary).body for x in getattr(b, "items", [b]))


def test_rounds_compare_runs_within_each_round_so_a_load_change_between_rounds_cancels(tmp_path):
    """The machine runs 1.6x slower from the fifth launch on (round 2, in reversed order): the two runs of
    equal speed are not distinguishable within the rounds, while their pooled steps could not say so,
    and the recomputing run is slower in both."""
    launch, calls = launcher(lambda i, key: 1.0 if i < 4 else 1.6)
    s = run_comparison(_spec(), store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=launch, rounds=2)
    order = [k for k, sweep in calls if sweep.endswith(":round2")]
    assert order == ["own dp2 recompute", "own dp2 mb1", "own dp2", "reference (single device)"]  # reversed
    runs = {r["label"]: r for r in s["runs"]}
    a, b = runs["own dp2"], runs["own dp2 mb1"]
    assert len(a["step_time_rounds_s"]) == 2 and len(a["metrics"]["step_times_s"]) == 24
    assert a["row"]["steps_measured"] == 24 and a["metrics"]["step_time_s"]["n"] == 24  # one source: every round
    pooled_ms = 1e3 * a["metrics"]["step_time_s"]["median"]
    nearest = min(abs(1e3 * sorted(r)[6] - pooled_ms) for r in a["step_time_rounds_s"])
    assert abs(a["breakdown_ms"]["step"] - pooled_ms) == nearest  # the breakdown of the round nearest the median
    within = compare_times(a["step_time_rounds_s"], b["step_time_rounds_s"])
    assert within["verdict"] == "not distinguishable" and within["rounds"] == 2  # each round's ratio, across rounds
    assert within["method"] == "t" and len(within["block_ratios"]) == 2
    assert s["load_drift"]["rounds"] == 2 and load_drift_factor(s) == 1.0
    why = _why(s)
    assert "every run is launched 2 times, in alternating order" in why
    assert "own dp2 recompute takes" in why and "Student's t on the mean of the 2 rounds' own log ratios" in why


def test_the_first_run_measured_again_after_the_last_widens_the_verdicts(tmp_path):
    """One launch each, and the reference again at the end, on a machine that slowed down 1.5x in the
    middle of the comparison: 'own dp2 mb1' looks 1.5x slower than 'own dp2', which the drift check
    names as what the load alone can make; the verdict is not 'slower'."""
    launch, calls = launcher(lambda i, key: 1.0 if i < 2 else 1.5)
    s = run_comparison(
        _spec(), store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=launch, drift_check=True
    )
    assert calls[-1] == ("reference (single device) (load drift check)", calls[0][1] + ":load-drift")
    d = s["load_drift"]
    assert d["verdict"] == "slower" and 1.4 < d["ratio"] < 1.6 and load_drift_factor(s) >= d["high"] > 1.4
    runs = {r["label"]: r for r in s["runs"]}
    assert (
        compare_times(runs["own dp2 mb1"]["metrics"]["step_times_s"], runs["own dp2"]["metrics"]["step_times_s"])[
            "verdict"
        ]
        == "slower"
    )  # what the steps alone say: the load's doing
    why = _why(s)
    assert "Load drift: reference (single device) was measured again after the last run" in why
    assert "own dp2 mb1 takes" not in why and "widened by the measured load drift" in why


def test_a_load_burst_during_one_launch_decides_nothing_across_rounds(tmp_path):
    """Other work ran during 'own dp2 mb1's first launch only (1.6x): its first round alone calls it slower
    than 'own dp2' of equal speed; over three alternating rounds the round is the unit (1.6x in one, 1.0x in
    the others: Student's t on three log ratios), so nothing is decided, and more rounds would decide."""
    launch, _ = launcher(lambda i, key: 1.6 if i == 2 else 1.0)
    s = run_comparison(_spec(), store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=launch, rounds=3)
    runs = {r["label"]: r["step_time_rounds_s"] for r in s["runs"]}
    a, b = runs["own dp2"], runs["own dp2 mb1"]
    assert compare_times(b[0], a[0])["verdict"] == "slower"  # one launch each: the load decides
    d = compare_times(b, a)  # alternating rounds: it does not
    assert d["verdict"] == "undecided" and d["blocks_needed"] > 3 and d["steps_needed"] is None
    assert [round(r, 1) for r in d["block_ratios"]] == [1.6, 1.0, 1.0]
    assert "more rounds decide, not more steps in each" in verdict_text(d)
    assert "own dp2 mb1 takes" not in _why(s)


def test_rounds_must_be_a_positive_count(no_launch, one_line_error):
    import yaml

    from harness.cli import main as cli_main

    (no_launch / "c.yaml").write_text(yaml.safe_dump({"name": "c", "runs": [{"engine": "own", "dp": 2}]}))
    line = one_line_error(cli_main(["compare", "c.yaml", "--rounds", "0"]))
    assert line.startswith("error: --rounds: must be a positive integer"), line
