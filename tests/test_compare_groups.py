"""Precision groups of a comparison (harness/compare/groups.py): a run whose workload override changes the
precision policy is checked against a single-device reference of its own policy at that policy's tolerance,
and the report sets runs side by side only within a group. Quick tier: plans, synthetic runs, fake launches."""

import pytest

from harness import cli
from harness.compare.groups import DEFAULT_TOLERANCE, check_groups, check_policies
from harness.compare.orchestrate import run_comparison
from harness.compare.parity import FAIL, PASS, check_parity
from harness.compare.spec import BF16_BASELINE, parse_compare_spec
from harness.errors import SpecError
from harness.model.training import precision_policy
from harness.report.compare import sections
from harness.report.compare_layouts import differs_texts, layout_matrix
from harness.report.compare_steps import console_lines, why_section
from harness.report.policy import policy_sentence, verdict_text
from harness.report.routing import routing_rows
from harness.spec import parse_spec
from harness.store import ResultsStore
from harness.testing.workloads import tiny_workload

FP8 = {"precision": "fp8", "fp8_recipe": "rowwise_with_gw_hp"}
FP8_REF = "reference fp8 rowwise_with_gw_hp (single device)"
REF = "reference (single device)"


def _raw(runs, **top):
    return {
        "name": "g",
        "nproc": 2,
        "workload": {**tiny_workload(), "steps": 2, "warmup_steps": 1},
        "runs": runs,
        **top,
    }


MIXED = [
    {"label": "fsdp", "engine": "fsdp"},
    {"label": "own fp8", "engine": "own", "workload": FP8},
    {"label": "planted", "engine": "own", "workload": {"seed": 7}},
]


def test_a_run_overriding_the_precision_gets_a_reference_and_tolerance_of_its_own():
    cs = parse_compare_spec(_raw(MIXED))
    assert [(p.label, p.group, p.is_reference) for p in cs.runs] == [
        (REF, "fp32", True),
        (FP8_REF, "fp8 rowwise_with_gw_hp", True),
        ("fsdp", "fp32", False),
        ("own fp8", "fp8 rowwise_with_gw_hp", False),
        ("planted", "fp32", False),  # a seed is no precision policy: the workload's group, its own reference
    ]
    own, fp8 = cs.groups
    assert (own.reference, own.tolerance, own.labels) == (REF, 1e-5, [REF, "fsdp", "planted"])
    assert (fp8.reference, fp8.tolerance, fp8.tolerance_source) == (
        FP8_REF,
        DEFAULT_TOLERANCE["fp8"],
        "default for fp8",
    )
    ref = next(p for p in cs.runs if p.label == FP8_REF)
    # the group's reference: the compare's workload with the override's policy fields, one process
    assert (ref.spec.workload.precision, ref.spec.workload.fp8_recipe, ref.spec.workload.seed) == (
        "fp8",
        "rowwise_with_gw_hp",
        1234,
    )
    assert ref.spec.layout.engine == "single" and ref.nproc == 1 and ref.workload_override == FP8
    assert (cs.tolerance, cs.tolerance_source) == (1e-5, "default for fp32")  # the workload's group's


def test_one_group_plans_as_before():
    cs = parse_compare_spec(_raw([{"engine": "fsdp"}, {"label": "p", "engine": "own", "workload": {"seed": 7}}]))
    assert len(cs.groups) == 1 and [p.label for p in cs.runs if p.is_reference] == [REF]
    mx = parse_compare_spec(_raw([{"engine": "own", "workload": {"precision": "fp8", "fp8_recipe": "mxfp8"}}]))
    assert mx.groups[1].name == "fp8 mxfp8" and mx.groups[1].tolerance == DEFAULT_TOLERANCE["mxfp8"]


def test_a_tolerance_cannot_serve_two_precisions(no_launch, tmp_path, capsys):
    with pytest.raises(SpecError) as e:
        parse_compare_spec(_raw(MIXED, tolerance=1e-4))
    assert e.value.field == "tolerance" and "fp32; fp8 rowwise_with_gw_hp, runs[1].workload" in e.value.reason
    parse_compare_spec(_raw(MIXED[:1], tolerance=1e-4))  # one group: as before
    import yaml

    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump(_raw(MIXED, tolerance=1e-4)))
    assert cli.main(["compare", str(spec), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: tolerance: one tolerance cannot serve")


def test_a_run_may_not_take_a_group_reference_label():
    with pytest.raises(SpecError) as e:
        parse_compare_spec(_raw([*MIXED, {"label": FP8_REF, "engine": "fsdp"}]))
    assert e.value.field == "runs[3].label" and "the run the harness adds" in e.value.reason


def test_an_fp8_workloads_bf16_baseline_is_the_bf16_groups_reference():
    raw = _raw(
        [{"label": "own", "engine": "own"}, {"label": "own bf16", "engine": "own", "workload": {"precision": "bf16"}}]
    )
    raw["workload"].update(precision="fp8")
    cs = parse_compare_spec(raw)
    twin = [p for p in cs.runs if p.label == BF16_BASELINE]
    assert len(twin) == 1 and twin[0].is_reference and not twin[0].baseline and twin[0].group == "bf16"
    assert cs.groups[1].labels == [BF16_BASELINE, "own bf16"] and cs.groups[1].tolerance == DEFAULT_TOLERANCE["bf16"]


def _run(label, losses, ref=False, grads=None):
    return {"label": label, "status": "ok", "losses": losses, "is_reference": ref, "grad_norms": grads or [1.0, 1.0]}


FP32_LOSSES = [5.5, 5.4, 5.3]
FP8_LOSSES = [5.51, 5.42, 5.31]  # 1.8e-3 to 3.7e-3 off fp32: far outside fp32's 1e-5, inside fp8's 5.7e-3


def _fake_cs():
    return parse_compare_spec(_raw(MIXED[:2]))


def test_each_run_is_checked_against_its_groups_reference_only():
    cs = _fake_cs()
    runs = [
        _run(REF, FP32_LOSSES, True),
        _run(FP8_REF, FP8_LOSSES, True),
        _run("fsdp", FP32_LOSSES),
        _run("own fp8", [x * (1 + 4e-3) for x in FP8_LOSSES]),  # within fp8's tolerance of its fp8 reference
    ]
    par = check_groups(runs, cs)
    assert (
        par["verdict"] == PASS
        and par["tolerance"] is None
        and [g["group"] for g in par["groups"]] == ["fp32", "fp8 rowwise_with_gw_hp"]
    )
    entry = next(p for p in par["runs"] if p["label"] == "own fp8")
    assert (entry["anchor"], entry["tolerance"], entry["verdict"]) == (FP8_REF, DEFAULT_TOLERANCE["fp8"], PASS)
    # against the fp32 reference at fp32's tolerance it would fail
    assert check_parity([runs[0], runs[3]], 3, 1e-5)["verdict"] == FAIL
    assert "own fp8" not in par["pairwise_max_rel_diff"]["fsdp"] and FP8_REF not in par["pairwise_max_rel_diff"][REF]
    assert par["max_pairwise_rel_diff"] == pytest.approx(4e-3, rel=1e-6)  # the fp8 group's, not fsdp vs own fp8
    runs[2] = _run("fsdp", [x * (1 + 2e-5) for x in FP32_LOSSES])  # outside fp32's tolerance: its group fails
    par = check_groups(runs, cs)
    assert par["verdict"] == FAIL and [g["verdict"] for g in par["groups"]] == [FAIL, PASS]


def test_one_group_gives_check_parity_as_it_is():
    cs = parse_compare_spec(_raw(MIXED[:1]))
    runs = [_run(REF, FP32_LOSSES, True), _run("fsdp", FP32_LOSSES)]
    assert check_groups(runs, cs) == check_parity(runs, cs.parity_steps, cs.tolerance)


def _census(compute):
    return {
        "parameters": {compute: 100},
        "master_parameters": {"fp32": 200} if compute != "fp32" else {},
        "gradients": {"fp32": 200},
        "optimizer_states": {"fp32": 400},
    }


def test_each_run_holds_its_own_groups_policy():
    cs = _fake_cs()
    runs = [
        {"label": label, "status": "ok", "metrics": {"memory_census": _census(c)}}
        for label, c in ((REF, "fp32"), (FP8_REF, "bf16"), ("fsdp", "fp32"), ("own fp8", "bf16"))
    ]
    pol = check_policies(runs, cs, "fp32")
    assert pol["same"] and [g["expected"]["compute"] for g in pol["groups"]] == ["fp32", "bf16"]
    text = policy_sentence({"policy": pol, "workload": {"precision": "fp32"}})  # each group's runs, not every run
    assert text.count("the same for every run of the group (") == 2 and "the same for every run (" not in text
    runs[3]["metrics"]["memory_census"]["optimizer_states"] = {"bf16": 400}  # an fp8 run with bf16 Adam states
    pol = check_policies(runs, cs, "fp32")
    assert not pol["same"] and list(pol["differ"]) == ["own fp8"]


def fake_launch(losses, tokens):
    """launch.run_spec's stand-in: the record a runner writes, its policy the spec's own, routing given."""

    def launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        workload = parse_spec({"workload": spec["workload"]}).workload
        rec = {
            "run_id": f"id-{point_key.replace(' ', '_')}",
            "schema_version": 1,
            "started_at": "t0",
            "ended_at": "t1",
            "status": "ok",
            "sweep": sweep,
            "point_key": point_key,
            "spec": spec,
            "fingerprint": {"hosts": ["n1"]},
            "launch": {"launcher": launcher, "log": "/tmp/x.log", "wall_s": 1.0},
            "metrics": {
                "losses": losses[point_key],
                "grad_norms": [1.0, 1.0, 1.0],
                "tokens_per_s": 1000.0,
                "step_time_s": {"median": 0.01, "ci95_low": 0.009, "ci95_high": 0.012, "n": 2},
                "step_times_s": [0.01, 0.0101],
                "engine": {"precision_policy": precision_policy(workload).describe()},
                "router": {"tokens_per_expert": tokens[point_key], "imbalance_max": [1.5], "aux_loss": [1.0]},
            },
        }
        ResultsStore(store_path).write(rec)
        return rec

    return launch


def _text(section) -> str:
    return "\n".join(str(getattr(b, "items", b)) for b in section.body)


def test_the_report_says_each_groups_parity_and_routing_against_its_own_reference(tmp_path):
    cs = parse_compare_spec(_raw([*MIXED[:2], {"label": "own fp8 dp2 b", "engine": "own", "workload": FP8}]))
    losses = {REF: FP32_LOSSES, "fsdp": FP32_LOSSES, FP8_REF: FP8_LOSSES, "own fp8": FP8_LOSSES}
    losses["own fp8 dp2 b"] = FP8_LOSSES
    fp32_routing, fp8_routing = {"layers.0": [4, 4, 8, 0]}, {"layers.0": [5, 3, 8, 0]}
    tokens = {k: fp8_routing if "fp8" in k else fp32_routing for k in losses}
    store = str(tmp_path / "r.sqlite")
    summary = run_comparison(cs, store_path=store, progress=False, launch_fn=fake_launch(losses, tokens))
    assert summary["verdict"] == PASS, verdict_text(summary)
    assert [g["name"] for g in summary["precision_groups"]] == ["fp32", "fp8 rowwise_with_gw_hp"]
    verdict = verdict_text(summary)
    assert "across the 2 finished runs of precision group fp32" in verdict
    assert "across the 3 finished runs of precision group fp8 rowwise_with_gw_hp" in verdict
    assert "tolerance 0.0057" in verdict and "FAILS" not in verdict
    parity = _text(next(s for s in sections(summary) if s.id == "parity"))
    assert "Runs of different groups are not compared with each other" in parity
    assert f"against the single-device reference (`{FP8_REF}`), tolerance **0.0057** (default for fp8)" in parity
    header, rows = routing_rows(summary)
    against = [row[header.index("against the reference")] for row in rows]
    assert against == ["-", "-", "equal (1 layers)", "equal (1 layers)", "equal (1 layers)"]
    why = _text(why_section(summary))
    assert "**Precision group fp32**" in why and "**Precision group fp8 rowwise_with_gw_hp**" in why
    assert "fsdp" not in why.split("**Precision group fp8 rowwise_with_gw_hp**")[1]  # no pair across groups
    lines = console_lines(summary)
    assert lines[0] == "fastest run of precision group fp32 (measured median): fsdp"
    assert not any("fsdp" in line and "own fp8" in line for line in lines)
    cells = [c for row in layout_matrix(summary)[1] for c in row[1:]]
    assert any("precision fp8 rowwise_with_gw_hp: not comparable" in c for c in cells)
    assert not any("not comparable" in c and c.startswith("10.0") and "fsdp" in c for c in cells)
    policy = policy_sentence(summary)
    assert policy.startswith("Precision policy, by precision group") and "**fp8 rowwise_with_gw_hp**" in policy
    differs = dict(zip((r["label"] for r in summary["runs"]), differs_texts(summary), strict=True))
    assert "fp8_recipe" not in differs["fsdp"] and "workload.precision=fp32" in differs["fsdp"]  # fp32 has no recipe
    assert "workload.fp8_recipe=rowwise_with_gw_hp" in differs["own fp8"]
    exceptions = [s for s in sections(summary) if s.id == "exceptions"]
    assert "ran another precision policy" not in (_text(exceptions[0]) if exceptions else "")
    tolerance = {r["comparison"]["label"]: r["comparison"]["tolerance"] for r in ResultsStore(store).records()}
    assert tolerance["own fp8"] == DEFAULT_TOLERANCE["fp8"] and tolerance["fsdp"] == 1e-5
    # a run routed apart from its own reference says so
    tokens["own fp8"] = fp32_routing
    summary = run_comparison(cs, store_path=store, progress=False, launch_fn=fake_launch(losses, tokens))
    header, rows = routing_rows(summary)
    assert rows[3][header.index("against the reference")] == "1 of 16 slots moved"


@pytest.mark.slow
def test_the_moe_example_passes_each_group_against_its_own_reference_and_routes_as_it(tmp_path):
    """examples/compare-cpu-moe-2proc.yaml's runs across engines and precisions (FSDP2 dp2 ep2 and DeepSpeed AutoEP
    ep2 in fp32, own dp2 ep2 in fp8 rowwise_with_gw_hp; its two other runs left out) over 1 measured step (parity
    is a maximum over the steps compared, routing an equality per step: both hold on fewer): every run within
    its group's tolerance of its group's reference, and its tokens per expert equal to that reference's."""
    import os

    from harness.testing.workloads import example_over

    cs = example_over(os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-moe-2proc.yaml"), 1)
    kept = (REF, FP8_REF, "FSDP2 dp2 ep2", "deepspeed ZeRO-1 dp2 ep2 AutoEP", "own fp8 dp2 ep2")  # one per engine
    cs.runs = [p for p in cs.runs if p.label in kept]
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, log_dir=str(tmp_path), profile_steps=1
    )
    assert summary["verdict"] == PASS, verdict_text(summary)
    anchors = {p["label"]: p["anchor"] for p in summary["parity"]["runs"]}
    assert anchors["FSDP2 dp2 ep2"] == REF and anchors["own fp8 dp2 ep2"] == FP8_REF
    header, rows = routing_rows(summary)
    against = {row[0]: row[header.index("against the reference")] for row in rows}
    assert len(against) == 5 and all(v == "equal (2 layers)" for k, v in against.items() if "reference" not in k)
