"""The baseline check's step times and a baseline of another comparison:
a change the intervals cannot tell is "undecided" with the smallest slowdown they could detect, never
"same"; a baseline whose name, workload or labels do not match is refused in one line before launch.
No process starts."""

from __future__ import annotations

import json
import math
import os
import random

import pytest

from harness.cli import main as cli_main
from harness.compare.spec import load_compare_spec
from harness.report.drift import baseline_sections, check_matches, compare_with_baseline, load_baseline, time_verdict
from harness.report.sections import Table

HERE = os.path.join(os.path.dirname(__file__), "..", "examples", "ci")


def test_the_issues_4_5x_slowdown_at_4_steps_is_undecided_not_same():
    """0.554x [0.389, 1.037] against 2.468x [0.593, 4.064] was read as 'same': the intervals meet, but a
    change of +757% would be needed before these steps could call one."""
    v = time_verdict((0.389, 0.554, 1.037, None), (0.593, 2.468, 4.064, None), 0.10)
    assert v["verdict"] == "undecided" and v["moved"] == 0.0
    assert v["detectable_slowdown"] == pytest.approx(1.1 * (2.468 / 0.554) / (0.593 / 1.037) - 1)
    assert v["detectable_slowdown"] > 7
    # tight intervals inside the tolerance: same; beyond it: DRIFT
    assert time_verdict((1.98, 2.0, 2.02, 0.95), (1.99, 2.01, 2.03, 0.95), 0.10)["verdict"] == "same"
    assert time_verdict((1.98, 2.0, 2.02, 0.95), (2.4, 2.45, 2.5, 0.95), 0.10)["verdict"] == "DRIFT"


def _summary(ref_times: list[float], dp_times: list[float]) -> dict:
    def run(label, engine, times, **extra):
        return {
            "label": label,
            "engine": engine,
            "layout": {"engine": engine, **({"dp": 2} if engine == "own" else {})},
            "status": "ok",
            "metrics": {"step_time_s": {"median": sorted(times)[len(times) // 2]}, "step_times_s": times},
            **extra,
        }

    return {
        "name": "t",
        "runs": [
            run("reference (single device)", "single", ref_times, is_reference=True),
            run("own dp2", "own", dp_times),
        ],
        "parity": {"steps": 0, "tolerance": 0.0},
    }


def test_step_times_give_the_ratio_its_interval_and_the_table_says_undecided():
    rng = random.Random(5)
    noisy = [0.02 * math.exp(rng.gauss(0, 0.4)) for _ in range(4)]
    ref = [0.01 * math.exp(rng.gauss(0, 0.4)) for _ in range(4)]
    b = compare_with_baseline(_summary(ref, noisy), _summary(ref, [4.5 * t for t in noisy]), 0.10)
    (row,) = [r for r in b["rows"] if r["what"].startswith("step time")]
    assert row["verdict"] == "undecided" and not b["drifts"]
    assert "(97.1%)" in row["before"]  # 4 steps each: the rank interval's exact coverage
    assert "these steps detect a slowdown of +" in row["after"]
    table = next(x for x in baseline_sections({"baseline": b})[0].body if isinstance(x, Table))
    assert ["own dp2", "undecided"] == [table.rows[-1][0], table.rows[-1][-1]]
    # 40 quiet steps each: the same 4.5x slowdown is a drift
    quiet = [0.02 * math.exp(rng.gauss(0, 0.05)) for _ in range(40)]
    ref = [0.01 * math.exp(rng.gauss(0, 0.05)) for _ in range(40)]
    b = compare_with_baseline(_summary(ref, quiet), _summary(ref, [4.5 * t for t in quiet]), 0.10)
    assert len(b["drifts"]) == 1 and b["drifts"][0].startswith("own dp2: step time relative to reference")


def _cs_and_baseline():
    cs = load_compare_spec(os.path.join(HERE, "tiny-compare.yaml"))
    return cs, load_baseline(os.path.join(HERE, "baseline.json"))


def test_the_shipped_ci_baseline_matches_its_spec():
    cs, old = _cs_and_baseline()
    check_matches(old, cs.name, cs.workload, [p.label for p in cs.runs], "baseline.json")


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda d: d.update(name="cpu-default"), "its comparison is 'cpu-default', this one is 'ci-tiny'"),
        (lambda d: d["workload"].update(seq_len=64), "its workload differs from this comparison's (seq_len 64 -> 32)"),
        (lambda d: [r.update(label=r["label"] + " old") for r in d["runs"]], "no run label in common"),
    ],
)
def test_a_baseline_of_another_comparison_is_refused_before_launch(no_launch, one_line_error, change, reason):
    """`harness compare examples/ci/tiny-compare.yaml --baseline <another comparison's JSON>` used to train
    every run and print a drift per figure; now one line, exit 2, nothing launched."""
    with open(os.path.join(HERE, "baseline.json")) as f:
        old = json.load(f)
    change(old)
    (no_launch / "old.json").write_text(json.dumps(old))
    (no_launch / "c.yaml").write_text(open(os.path.join(HERE, "tiny-compare.yaml")).read())
    line = one_line_error(cli_main(["compare", "c.yaml", "--baseline", "old.json"]))
    assert line.startswith("error: --baseline: old.json: ") and reason in line, line


def test_a_workload_override_is_another_workload(no_launch, one_line_error):
    (no_launch / "c.yaml").write_text(open(os.path.join(HERE, "tiny-compare.yaml")).read())
    with open(os.path.join(HERE, "baseline.json")) as f:
        (no_launch / "old.json").write_text(f.read())
    args = ["compare", "c.yaml", "--baseline", "old.json", "--set", "workload.optimizer.lr=0.01"]
    line = one_line_error(cli_main(args))
    assert "its workload differs" in line and "optimizer" in line, line
    cs, old = _cs_and_baseline()  # more measured steps are the same workload (steps is not compared)
    check_matches(old, cs.name, {**cs.workload, "steps": 40}, [p.label for p in cs.runs], "old.json")
