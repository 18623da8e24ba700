"""`harness plan --findings`: the study's findings as the plan predicts them per hardware profile,
each verdict read off the two layouts it compares."""

from __future__ import annotations

import json

import pytest

from harness.cli import main as cli
from harness.model.presets import PRESETS
from harness.planner import findings
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.predict import Prediction, predict

# A small plan (16 GPUs, 128 sequences) keeps each profile's plan well under a second.
PLAN = ["plan", "--model", "paper-13b", "--seq-len", "2048", "--global-batch-size", "128", "--gpus", "16"]
PROFILES = ("a100-40gb", "a100-80gb", "h100-sxm", "h200")


def run(capsys, *argv):
    code = cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_findings_table_has_a_row_per_finding_and_a_column_per_profile(capsys):
    code, out, _ = run(capsys, *PLAN, "--findings", "--hardware", ",".join(PROFILES))
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("finding"))
    assert header.split() == ["finding", *PROFILES, "across", "profiles"]
    table = lines[lines.index(header) + 1 : lines.index(header) + 1 + len(findings.QUESTIONS)]
    assert [line[: len(q)] for line, q in zip(table, findings.QUESTIONS.values(), strict=True)] == list(
        findings.QUESTIONS.values()
    )
    for line in table:
        assert line.rstrip().endswith(("same", "moves", "-"))
    # each compared layout is named in full below the table, per profile
    assert "compared layouts (MFU, layout):" in lines
    assert sum(line.startswith("    a100-40gb: ") for line in lines) == len(findings.QUESTIONS)


def test_findings_json_verdicts_follow_from_the_compared_predictions(capsys):
    """Every judged verdict is what predict() says of the two layouts it names, each of them fits,
    has (or lacks) the property, and is the best such layout of the plan's own ranking."""
    names = ("a100-80gb", "h100-sxm")
    code, out, _ = run(capsys, *PLAN, "--findings", "--hardware", ",".join(names), "--format", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["profiles"] == list(names)
    wl, shape = Workload(2048, 128), PRESETS["paper-13b"]
    checked = 0
    for name in names:
        prof = load_profile(name)
        code, plan_out, _ = run(capsys, *PLAN, "--hardware", name, "--format", "json")
        fitting = [row for row in json.loads(plan_out) if row["fits"]]
        for finding in doc["findings"]:
            cell = finding["profiles"][name]
            if not cell["judged"] or finding["finding"] == "best_mfu":
                continue
            a, b = (predict(shape, PlannerLayout(**cell[k]["layout"]), wl, prof) for k in ("with", "without"))
            assert a.fits and a.available and b.fits and b.available
            assert cell["with"]["mfu"] == round(a.mfu, 4) and cell["without"]["mfu"] == round(b.mfu, 4)
            verdict = "yes" if a.mfu > b.mfu else "no" if a.mfu < b.mfu else "tie"
            if finding["finding"] == "sequence_parallel":
                assert a.layout.sequence_parallel and not b.layout.sequence_parallel
                assert a.layout.tp == b.layout.tp == cell["tp"]
                assert cell["verdict"] == (f"tp{cell['tp']}" if verdict == "yes" else "never")
                continue
            _, has, lacks, *_ = findings.PAIRED[finding["finding"]]
            assert has(a.layout) and lacks(b.layout)
            assert cell["verdict"] == verdict
            # the best of each side in the plan's own table (its JSON rows: layout fields, rounded MFU)
            for side, keep in (("with", has), ("without", lacks)):
                best = max(row["mfu"] for row in fitting if keep(_layout(row)))
                assert cell[side]["mfu"] == best
            checked += 1
        best = next(f for f in doc["findings"] if f["finding"] == "best_mfu")["profiles"][name]
        assert best["with"]["mfu"] == max(row["mfu"] for row in fitting)
    assert checked >= 6  # most paired findings were judged on both profiles


def _layout(row: dict) -> PlannerLayout:
    return PlannerLayout(
        tp=row["tp"],
        pp=row["pp"],
        dp=row["dp"],
        micro_batch_size=row["micro_batch_size"],
        activation_checkpointing=row["activation_checkpointing"],
        sequence_parallel=row["sequence_parallel"],
        attention=row["attention"],
        rmsnorm=row["rmsnorm"],
        cp=row["cp"],
    )


def test_a_finding_without_one_side_is_not_judged(capsys):
    code, out, _ = run(capsys, *PLAN, "--findings", "--hardware", "a100-80gb", "--micro-batch-sizes", "1")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("micro-batch 1 best?"))
    assert "not judged: no fitting layout with mb > 1" in row


def _pred(tp: int, sp: bool, mfu: float, fits: bool = True) -> Prediction:
    lay = PlannerLayout(tp, 1, 16 // tp, 1, sequence_parallel=sp)
    return Prediction(lay, fits, True, 1.0, 1.0 / mfu, mfu, 1.0, 0)


def test_sequence_parallel_pays_from_the_smallest_tp_where_it_wins_or_alone_fits():
    judge = findings._sequence_parallel
    assert judge([_pred(2, True, 0.5), _pred(2, False, 0.6), _pred(4, True, 0.5), _pred(4, False, 0.4)]).verdict == (
        "tp4"
    )
    alone = judge([_pred(2, True, 0.5), _pred(2, False, 0.6), _pred(4, True, 0.3), _pred(4, False, 0.4, fits=False)])
    assert (alone.verdict, alone.without) == ("tp4", None)
    never = judge([_pred(2, True, 0.5), _pred(2, False, 0.6), _pred(4, True, 0.3), _pred(4, False, 0.4)])
    assert (never.verdict, never.at_tp, never.with_.mfu, never.without.mfu) == ("never", 4, 0.3, 0.4)
    assert not judge([_pred(2, False, 0.6), _pred(2, True, 0.5, fits=False)]).judged


def test_a_comma_list_of_profiles_needs_findings(no_launch, one_line_error):
    line = one_line_error(cli([*PLAN, "--hardware", "a100-80gb,h100-sxm"]))
    assert "--hardware" in line and "--findings" in line


@pytest.mark.parametrize("flag", [["--export", "megatron"], ["--top", "3"], ["--explain"]])
def test_findings_refuses_the_single_plan_outputs(no_launch, one_line_error, flag):
    line = one_line_error(cli([*PLAN, "--findings", *flag]))
    assert line.startswith("error: --findings:") and flag[0] in line


@pytest.mark.slow  # a fresh Python process
def test_findings_import_no_torch():
    from conftest import heavy_imports_after

    code = (
        f"from harness.cli import main\nassert main({[*PLAN, '--findings', '--hardware', 'a100-80gb,h200']!r}) == 0\n"
    )
    heavy = heavy_imports_after(code)
    assert not heavy, heavy[:5]
