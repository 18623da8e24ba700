"""`harness compare SPEC --baseline OLD.json`: every kind of drift from an earlier comparison's JSON
report (losses, census, step-time ratios, runs added, dropped or changed), a malformed baseline
refused before launch, the report's Baseline section, and a tiny comparison run twice."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from harness.cli import main as cli_main
from harness.errors import SpecError
from harness.report.drift import baseline_sections, compare_with_baseline, load_baseline
from harness.report.sections import Table
from harness.testing.workloads import tiny_workload

LOSSES = [5.5, 5.4, 5.3, 5.2]
TOL = 1e-5  # the fp32 parity tolerance (harness.compare.spec.DEFAULT_TOLERANCE)
CENSUS = {"parameters": {"fp32": 500992}, "optimizer_states": {"fp32": 1002068}}


def _run(label, engine, median, is_reference=False, status="ok", **layout):
    return {
        "label": label,
        "engine": engine,
        "layout": {"engine": engine, **layout},
        "status": status,
        "is_reference": is_reference,
        "metrics": {"step_time_s": {"median": median}, "memory_census": copy.deepcopy(CENSUS)}
        if status == "ok"
        else {},
    }


def summary(ref_s=0.010, dp_s=0.020, tp_s=0.030) -> dict:
    """A comparison's JSON report as `harness compare` writes it, with what the baseline check reads."""
    runs = [
        _run("reference (single device)", "single", ref_s, is_reference=True),
        _run("own dp2", "own", dp_s, dp=2),
        _run("own tp2", "own", tp_s, tp=2),
    ]
    return {
        "name": "t",
        "runs": runs,
        "parity": {"steps": 3, "tolerance": TOL},
        "loss_curves": {r["label"]: list(LOSSES) for r in runs},
    }


def drifts(old, new, tol=0.10) -> list[str]:
    return compare_with_baseline(old, new, tol)["drifts"]


def test_the_same_figures_are_no_drift_and_the_section_says_so():
    b = compare_with_baseline(summary(), summary(), 0.10, "old.json")
    assert b["drifts"] == [] and b["time_reference"] == "reference (single device)"
    assert {(r["run"], r["what"].split(" (tolerance")[0]) for r in b["rows"]} >= {
        ("own dp2", "loss, first 3 steps"),
        ("own dp2", "census parameters fp32"),
        ("own dp2", "step time relative to reference (single device)'s [interval]"),
    }
    (section,) = baseline_sections({"baseline": b})
    assert section.title == "Baseline" and "**0 drift(s)**: the runs match the baseline." in section.body
    table = next(x for x in section.body if isinstance(x, Table))
    assert table.headers == ["Run", "Compared", "Baseline", "Now", "Verdict"]
    assert {row[-1] for row in table.rows} == {"same"}
    assert baseline_sections({}) == []  # no --baseline: no section


def test_a_loss_beyond_the_parity_tolerance_is_a_drift_and_one_within_it_is_not():
    new = summary()
    new["loss_curves"]["own dp2"][1] = 5.4 * (1 + 2 * TOL)  # twice the tolerance: outside
    new["loss_curves"]["own tp2"][2] = 5.3 * (1 + TOL / 2)  # half of it: inside
    new["loss_curves"]["reference (single device)"][3] = 9.9  # past the 3-step parity window: not compared
    assert drifts(summary(), new) == ["own dp2: loss at step 1: 5.4 -> 5.400108 (rel. diff 2.0e-05 > tolerance 1e-05)"]
    new["loss_curves"]["own tp2"][0] = float("nan")
    assert any(d.startswith("own tp2: loss at step 0: 5.5 -> nan") for d in drifts(summary(), new))
    new["loss_curves"]["own tp2"] = LOSSES[:2]  # stopped early
    assert "own tp2: losses: 3 of the first 3 steps in the baseline, 2 now" in drifts(summary(), new)


def test_a_census_byte_count_that_differs_or_appears_is_a_drift():
    new = summary()
    census = new["runs"][1]["metrics"]["memory_census"]
    census["parameters"]["fp32"] += 4
    census["buffers"] = {"fp32": 1024}
    assert drifts(summary(), new) == [
        "own dp2: census buffers fp32: none -> 1,024 B",
        "own dp2: census parameters fp32: 500,992 B -> 500,996 B",
    ]


def test_step_times_are_compared_as_ratios_to_the_reference_of_the_same_comparison():
    # a machine twice as busy: every step twice as long, every ratio the same
    assert drifts(summary(), summary(ref_s=0.020, dp_s=0.040, tp_s=0.060)) == []
    # the same absolute step time while the reference got faster: own dp2's ratio 2.0 -> 2.5 (+25%)
    moved = drifts(summary(), summary(ref_s=0.008, dp_s=0.020, tp_s=0.024))
    assert moved == [
        "own dp2: step time relative to reference (single device)'s: 2.000x [2.000, 2.000] -> "
        "2.500x [2.500, 2.500] (beyond both intervals by +25.0%, tolerance 10%)"
    ]
    # +5% is inside 10% and outside 4%: the tolerance is the user's
    slower = summary(dp_s=0.021)
    assert drifts(summary(), slower) == []
    assert drifts(summary(), slower, 0.04) == [
        "own dp2: step time relative to reference (single device)'s: 2.000x [2.000, 2.000] -> "
        "2.100x [2.100, 2.100] (beyond both intervals by +5.0%, tolerance 4%)"
    ]
    assert drifts(summary(), summary(dp_s=1.0), None) == []  # --time-tolerance inf: not compared


def with_ci(s: dict, label: str, low: float, high: float) -> dict:
    run = next(r for r in s["runs"] if r["label"] == label)
    run["metrics"]["step_time_s"].update(ci95_low=low, ci95_high=high)
    return s


def test_a_ratio_is_carried_with_its_confidence_interval():
    # own dp2 measured 2.5x on a busy rerun, but its median's CI (18-30 ms) reaches back to 2.0x:
    # noise, not a drift
    noisy = with_ci(summary(ref_s=0.008, dp_s=0.020, tp_s=0.024), "own dp2", 0.0144, 0.030)
    assert drifts(summary(), noisy) == []
    # the same median with a tight CI (19.6-20.4 ms: ratio 2.45-2.55) is 22.5% beyond the baseline's 2.0x
    tight = with_ci(summary(ref_s=0.008, dp_s=0.020, tp_s=0.024), "own dp2", 0.0196, 0.0204)
    assert drifts(summary(), tight)[0].endswith("(beyond both intervals by +22.5%, tolerance 10%)")
    # a run that got 2x slower with noisy CIs on both sides still drifts
    old = with_ci(summary(), "own dp2", 0.018, 0.022)
    slow = with_ci(summary(dp_s=0.040), "own dp2", 0.032, 0.048)
    assert drifts(old, slow)[0].endswith("(beyond both intervals by +45.5%, tolerance 10%)")


def test_a_step_time_drift_on_a_busy_machine_says_so():
    busy = summary(ref_s=0.008)
    busy.update(
        load_average={"before": [1.2, 1.0, 1.0], "after": [4.84, 3.0, 2.0]}, fingerprints={"common": {"cpu_cores": 2}}
    )
    b = compare_with_baseline(summary(), busy, 0.10)
    assert b["drifts"][0].endswith("by +25.0%, tolerance 10%); the machine was busy (now: load 4.84 on 2 cores)")
    (section,) = baseline_sections({"baseline": b})
    assert any(
        isinstance(x, str) and x.startswith("The machine was busy (now: load 4.84 on 2 cores") for x in section.body
    )
    busy["load_average"]["after"][0] = 2.0  # at the core count: not busy
    assert "busy" not in compare_with_baseline(summary(), busy, 0.10)["drifts"][0]


def test_without_a_reference_the_first_run_in_both_is_the_time_reference():
    old, new = summary(), summary(dp_s=0.030, tp_s=0.045)  # tp2 / dp2 = 1.5 in both
    for s in (old, new):
        s["runs"] = s["runs"][1:]
    b = compare_with_baseline(old, new, 0.10)
    assert b["time_reference"] == "own dp2" and b["drifts"] == []


def test_runs_added_dropped_failed_or_changed_under_their_label_are_each_a_line():
    old, new = summary(), summary()
    new["runs"][2] = _run("own tp2", "own", None, status="failed", tp=2)
    new["runs"][1]["layout"]["micro_batch_size"] = 4
    new["runs"].append(_run("fsdp dp2", "fsdp", 0.02, dp=2))
    old["runs"].append(_run("deepspeed ZeRO-1", "deepspeed", 0.02, dp=2, zero_stage=1))
    lines = drifts(old, new)
    assert (
        lines[0]
        == "own dp2: layout own tp1 pp1 dp2 mb1 ckpt=none sdpa/torch -> own tp1 pp1 dp2 mb4 ckpt=none sdpa/torch"
    )
    assert lines[1:] == [
        "own tp2: status ok -> failed",
        "fsdp dp2: not in the baseline",
        "deepspeed ZeRO-1: in the baseline, not run now",
    ]


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "cannot be read"),
        ("{not json", "not JSON"),
        (json.dumps([1, 2]), "not a `harness compare` JSON report"),
        (json.dumps({"runs": [{"status": "ok"}]}), "runs[0] has no label or status"),
        (json.dumps({"runs": [], "loss_curves": {"a": "x"}}), "loss_curves must map run labels to lists"),
        (json.dumps({"runs": [{"label": "a", "status": "ok", "layout": {"tp": "x"}}]}), "runs[0] (a): layout: "),
    ],
)
def test_a_malformed_baseline_is_one_line_and_nothing_launches(no_launch, one_line_error, content, reason):
    if content is not None:
        (no_launch / "old.json").write_text(content)
    (no_launch / "c.yaml").write_text(yaml.safe_dump({"name": "c", "runs": [{"engine": "own", "dp": 2}]}))
    line = one_line_error(cli_main(["compare", "c.yaml", "--baseline", "old.json"]))
    assert line.startswith("error: --baseline: old.json: ") and reason in line, line
    with pytest.raises(SpecError, match="--baseline"):
        load_baseline(str(no_launch / "old.json"))


def test_a_time_tolerance_needs_a_baseline_and_a_sign(no_launch, one_line_error):
    (no_launch / "c.yaml").write_text(yaml.safe_dump({"name": "c", "runs": [{"engine": "own", "dp": 2}]}))
    (no_launch / "old.json").write_text(json.dumps(summary()))
    line = one_line_error(cli_main(["compare", "c.yaml", "--time-tolerance", "0.2"]))
    assert line.startswith("error: --time-tolerance: only with --baseline")
    line = one_line_error(cli_main(["compare", "c.yaml", "--baseline", "old.json", "--time-tolerance", "-1"]))
    assert line.startswith("error: --time-tolerance: must be a non-negative fraction")


def test_the_committed_ci_example_loads_and_its_spec_parses():
    import os

    from harness.compare.spec import load_compare_spec

    here = os.path.join(os.path.dirname(__file__), "..", "examples", "ci")
    cs = load_compare_spec(os.path.join(here, "tiny-compare.yaml"))
    old = load_baseline(os.path.join(here, "baseline.json"))
    assert [r.label for r in cs.runs] == [r["label"] for r in old["runs"]]
    assert old["verdict"] == "pass" and compare_with_baseline(old, old)["drifts"] == []
    workflow = open(os.path.join(here, "github-actions.yml")).read()
    assert "--baseline examples/ci/baseline.json" in workflow and "pip install ." in workflow


# ------------------------------------------------------------------ end to end (real launches)


@pytest.mark.slow
def test_a_rerun_matches_its_baseline_and_another_learning_rate_drifts(tmp_path, cli):
    """The reference and own dp2 on the tiny model, three times: the first report is the baseline;
    the same spec again exits 0; a baseline whose losses moved exits 1 naming the loss. Step times are not
    compared here (--time-tolerance inf): they depend on the machine's load, and the ratio logic is
    checked above on fixed figures."""
    spec = {
        "name": "ci",
        "nproc": 2,
        "parity_steps": 3,
        "timeout_s": 240,
        "workload": tiny_workload(steps=2, warmup_steps=1),
        "runs": [{"engine": "own", "dp": 2}],
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    common = ["--store", "r.sqlite", "--no-progress", "--profile-steps", "0"]  # nothing here reads a profile
    first = cli("compare", "c.yaml", *common, "--out", "a", cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    again = ("--baseline", "a/compare-ci.json", "--time-tolerance", "inf")
    rerun = cli("compare", "c.yaml", *common, "--out", "b", *again, cwd=tmp_path, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "baseline a/compare-ci.json: 0 drift(s)" in rerun.stdout
    assert "**0 drift(s)**" in (tmp_path / "b" / "compare-ci.md").read_text()
    # a change to the training, as a baseline whose losses moved (another workload is refused, exit 2)
    old = json.loads((tmp_path / "a" / "compare-ci.json").read_text())
    for curves in (old["loss_curves"], old["loss_table"]):
        for losses in curves.values():
            losses[1] *= 1.01
    (tmp_path / "moved.json").write_text(json.dumps(old))
    moved = ("--baseline", "moved.json", "--time-tolerance", "inf")
    changed = cli("compare", "c.yaml", *common, "--out", "c", *moved, cwd=tmp_path, timeout=600)
    assert changed.returncode == 1, changed.stdout + changed.stderr
    assert "verdict: PASS" in changed.stdout  # the runs agree with each other, not with the baseline
    assert "drift: own dp2: loss at step 1: " in changed.stdout
    assert "drift: reference (single device): loss at step 1: " in changed.stdout
    md = (tmp_path / "c" / "compare-ci.md").read_text()
    assert "## Baseline" in md and "| DRIFT |" in md
