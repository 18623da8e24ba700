"""`harness compare`: spec checks, parity and fingerprint verdicts, the report, and an end-to-end
run in which a planted difference (another seed for one engine) fails the comparison."""

import json
import os

import pytest
import yaml

from harness.compare.orchestrate import run_comparison
from harness.compare.parity import FAIL, NO_DATA, PASS, check_parity, compare_fingerprints
from harness.compare.spec import DEFAULT, parse_compare_spec
from harness.errors import SpecError
from harness.report.compare import write_report
from harness.report.compare_layouts import layout_matrix
from harness.store import ResultsStore
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload()
REF = [5.5, 5.4, 5.3]
POLICY_FP32 = "fp32 throughout: parameters, gradients, optimizer states and every collective"


# ------------------------------------------------------------------ parity


def test_parity_passes_within_tolerance_and_fails_outside():
    runs = [
        {"label": "ref", "status": "ok", "losses": REF, "is_reference": True},
        {"label": "a", "status": "ok", "losses": [x * (1 + 5e-6) for x in REF]},
        {"label": "planted", "status": "ok", "losses": [5.5, 5.41, 5.3]},
    ]
    p = check_parity(runs, 3, 1e-5)
    verdicts = {r["label"]: r["verdict"] for r in p["runs"]}
    assert verdicts == {"ref": PASS, "a": PASS, "planted": FAIL}
    assert p["verdict"] == FAIL
    assert p["anchor"] == "ref"
    planted = next(r for r in p["runs"] if r["label"] == "planted")
    assert planted["worst_step"] == 1 and "5.41 vs 5.4" in planted["note"]
    assert p["max_pairwise_rel_diff"] == pytest.approx(0.01 / 5.4, rel=1e-3)
    assert check_parity(runs[:2], 3, 1e-5)["verdict"] == PASS


def test_parity_only_first_n_steps_and_failed_runs_have_no_data():
    runs = [
        {"label": "ref", "status": "ok", "losses": REF + [1.0], "is_reference": True},
        {"label": "late", "status": "ok", "losses": REF + [2.0]},
        {"label": "crashed", "status": "failed", "losses": []},
    ]
    p = check_parity(runs, 3, 1e-5)
    verdicts = {r["label"]: r["verdict"] for r in p["runs"]}
    assert verdicts == {"ref": PASS, "late": PASS, "crashed": NO_DATA}
    assert p["verdict"] == FAIL  # a run that cannot prove parity fails the comparison


def test_parity_without_reference_anchors_on_first_finished_run():
    runs = [
        {"label": "x", "status": "timeout", "losses": []},
        {"label": "a", "status": "ok", "losses": REF},
        {"label": "b", "status": "ok", "losses": REF},
    ]
    p = check_parity(runs, 3, 1e-5)
    assert p["anchor"] == "a" and "reference did not run" in p["anchor_kind"]


def test_fingerprint_differences_flagged_by_group():
    fp = {
        "hosts": ["n1"],
        "device_name": "H100",
        "torch": "2.13.0",
        "deepspeed": "0.19.8",
        "world_size": 2,
        "env": {"OMP_NUM_THREADS": "1"},
    }
    same = compare_fingerprints(
        [{"label": "a", "fingerprint": fp}, {"label": "b", "fingerprint": {**fp, "world_size": 1, "env": {}}}]
    )
    assert same["same"] and same["common"]["device_name"] == "H100"
    diff = compare_fingerprints(
        [
            {"label": "a", "fingerprint": fp},
            {"label": "b", "fingerprint": {**fp, "hosts": ["n2"], "deepspeed": "0.18.0"}},
            {"label": "c", "fingerprint": {**fp, "device_name": "A100"}},
        ]
    )
    assert not diff["same"]
    assert diff["flagged_groups"] == ["devices", "hosts", "library versions"]
    by_key = {d["key"]: d for d in diff["differences"]}
    assert by_key["deepspeed"]["values"] == {"a": "0.19.8", "b": "0.18.0", "c": "0.19.8"}


# ------------------------------------------------------------------ spec


def compare_raw(runs, **top):
    return {"name": "t", "nproc": 2, "parity_steps": 2, "workload": dict(WORKLOAD), "runs": runs, **top}


def test_default_spec_is_valid_and_covers_the_engines():
    cs = parse_compare_spec(json.loads(json.dumps(DEFAULT)))
    engines = [r.spec.layout.engine for r in cs.runs] + [lab.split()[0] for lab, _ in cs.skipped]
    assert engines.count("deepspeed") == 5 and engines.count("fsdp") == 4 and "single" in engines
    assert engines.count("megatron") == 3
    assert {r.spec.layout.zero_stage for r in cs.runs if r.spec.layout.engine == "deepspeed"} == {1, 2, 3}
    for tp, pp in ((2, 1), (1, 2)):  # the same tp2 and pp2 layouts under all four engines
        assert {r.spec.layout.engine for r in cs.runs if (r.spec.layout.tp, r.spec.layout.pp) == (tp, pp)} == {
            "own",
            "deepspeed",
            "fsdp",
            "megatron",
        }
    assert all(r.launcher == "deepspeed" for r in cs.runs if r.spec.layout.engine == "deepspeed")
    assert cs.tolerance == 1e-5


@pytest.mark.parametrize("name", ["compare-node8.yaml", "compare-node8-3d.yaml"])
def test_example_compare_specs_are_valid(name):
    from harness.compare.spec import load_compare_spec

    cs = load_compare_spec(os.path.join(os.path.dirname(__file__), "..", "examples", name))
    assert cs.nproc == 8 and all(r.nproc == 8 for r in cs.runs)
    if name == "compare-node8-3d.yaml":  # five layouts under three engines, two of them DeepSpeed cannot run
        assert len(cs.runs) + len(cs.not_runnable) == 15 and len(cs.not_runnable) == 2


def test_missing_engine_is_skipped_with_a_note(monkeypatch):
    import harness.compare.spec as cspec

    monkeypatch.setattr(cspec, "engine_available", lambda engine: engine != "own")
    cs = parse_compare_spec(compare_raw([{"engine": "own", "dp": 2}, {"engine": "fsdp"}]))
    assert [r.label for r in cs.runs] == ["reference (single device)", "FSDP2 reshard"]
    assert cs.skipped[0][0] == "own dp2" and "not available" in cs.skipped[0][1]


@pytest.mark.parametrize(
    "raw,field,reason",
    [
        (compare_raw([{"engine": "fsdp"}], colour=1), "colour", "unknown key"),
        (compare_raw([]), "runs", "non-empty"),
        (compare_raw([{"engine": "fsdp", "bogus": 1}]), "runs[0].bogus", "unknown key"),
        (compare_raw([{"engine": "fsdp", "dp": 4}]), "runs[0]", "world size 2 != tp x cp x pp x dp"),
        (compare_raw([{"engine": "deepspeed", "zero_stage": 5}]), "runs[0].zero_stage", "1, 2 or 3"),
        (compare_raw([{"engine": "fsdp"}], parity_steps=9), "parity_steps", "steps each run trains"),
        (compare_raw([{"engine": "fsdp"}, {"engine": "fsdp"}]), "runs[1].label", "used twice"),
        ({**compare_raw([{"engine": "fsdp"}]), "workload": {"seq_len": 0}}, "workload.seq_len", "must be positive"),
    ],
)
def test_invalid_compare_spec(raw, field, reason):
    with pytest.raises(SpecError) as e:
        parse_compare_spec(raw)
    assert e.value.field == field and reason in e.value.reason


# ------------------------------------------------------------------ report (fake launches)


def fake_launcher(results):
    """A stand-in for launch.run_spec that writes the record a runner would have written."""

    def launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        status, losses, fp = results[point_key]
        rec = {
            "run_id": f"id-{len(point_key)}-{point_key.replace(' ', '_')}",
            "schema_version": 1,
            "status": status,
            "error": None if status == "ok" else "RuntimeError: boom\nmore",
            "started_at": "t0",
            "ended_at": "t1",
            "sweep": sweep,
            "point_key": point_key,
            "spec": spec,
            "fingerprint": fp,
            "launch": {"launcher": launcher, "log": "/tmp/x.log", "wall_s": 1.0},
            "metrics": {}
            if status != "ok"
            else {
                "losses": losses,
                "tokens_per_s": 1000.0,
                "peak_memory_bytes": 2**28,
                "memory_kind": "peak_rss",
                "step_time_s": {"median": 0.01, "ci95_low": 0.009, "ci95_high": 0.012, "n": 2},
                "mfu": None,
                "mfu_vs_measured_matmul": {"palm": 0.05},
                "engine": {"precision_policy": POLICY_FP32, "optimizer": "AdamW"},
            },
        }
        ResultsStore(store_path).write(rec)
        return rec

    return launch


def test_report_shows_failure_fingerprint_difference_and_records_verdict(tmp_path):
    fp = {"hosts": ["n1"], "device_name": "cpu", "torch": "2.13.0", "deepspeed": "0.19.8"}
    cs = parse_compare_spec(
        compare_raw(
            [{"engine": "fsdp"}, {"engine": "deepspeed", "zero_stage": 1}, {"engine": "deepspeed", "zero_stage": 3}]
        )
    )
    results = {
        "reference (single device)": ("ok", REF, fp),
        "FSDP2 reshard": ("ok", REF, {**fp, "hosts": ["n2"]}),
        "deepspeed ZeRO-1": ("ok", [5.5, 5.45, 5.3], fp),
        "deepspeed ZeRO-3": ("failed", [], {}),
    }
    store = str(tmp_path / "r.sqlite")
    summary = run_comparison(cs, store_path=store, progress=False, launch_fn=fake_launcher(results))
    paths = write_report(summary, str(tmp_path))
    assert summary["verdict"] == FAIL and summary["failed_runs"] == ["deepspeed ZeRO-3"]
    md = open(paths["markdown"]).read()
    html = open(paths["html"]).read()
    assert "**Verdict: FAIL**" in md and "Parity failures" in md
    assert "| deepspeed ZeRO-1 |" in md and "FAIL" in md and "step 1: 5.45 vs 5.4" in md
    assert "Tolerance: max relative difference **1e-05**" in md
    assert "Runs differ in hosts" in md and "## Failed runs" in md and "RuntimeError: boom" in md
    assert "<table>" in html and "<b>Verdict: FAIL</b>" in html and "Runs differ in hosts" in html
    recs = {r["comparison"]["label"]: r["comparison"] for r in ResultsStore(store).records()}
    assert recs["deepspeed ZeRO-1"]["parity"]["verdict"] == FAIL
    assert recs["FSDP2 reshard"]["parity"]["verdict"] == PASS and recs["FSDP2 reshard"]["verdict"] == FAIL
    assert recs["deepspeed ZeRO-3"]["parity"]["verdict"] == NO_DATA
    assert json.load(open(paths["json"]))["parity"]["tolerance"] == 1e-5


def test_matrix_shows_every_layout_under_every_engine_with_reasons(tmp_path):
    raw = {
        "name": "m",
        "nproc": 4,
        "parity_steps": 2,
        "reference": False,
        "workload": {**WORKLOAD, "model_overrides": {"layers": 4}},
        "matrix": {
            "engines": [{"engine": "own"}, {"engine": "deepspeed", "zero_stage": 1}, {"engine": "fsdp"}],
            "layouts": [{"dp": 4}, {"tp": 2, "pp": 2, "dp": 1}, {"tp": 2, "dp": 2, "sequence_parallel": True}],
        },
    }
    cs = parse_compare_spec(raw)
    labels = [r.label for r in cs.runs]
    assert labels == [
        "own dp4",
        "deepspeed ZeRO-1 dp4",
        "FSDP2 reshard dp4",
        "own tp2 pp2",
        "FSDP2 reshard tp2 pp2",
        "own tp2 dp2 sp",
        "FSDP2 reshard tp2 dp2 sp",
    ]
    assert [(n["label"], n["why"].split(":")[0]) for n in cs.not_runnable] == [
        ("deepspeed ZeRO-1 tp2 pp2", "layout.tp"),
        ("deepspeed ZeRO-1 tp2 dp2 sp", "layout.sequence_parallel"),
    ]
    fp = {"hosts": ["n1"]}
    results = {label: ("ok", REF, fp) for label in labels}
    results["FSDP2 reshard tp2 pp2"] = ("failed", [], {})
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=fake_launcher(results)
    )
    header, rows = layout_matrix(summary)
    assert header == ["layout", "own", "deepspeed ZeRO-1", "FSDP2 reshard"]
    by_row = {r[0]: r[1:] for r in rows}
    assert by_row["dp4 mbs 1"][0] == "10.0 ms [9.0, 12.0] (50%) pass"  # 2 steps: the range covers 50%
    assert by_row["tp2 pp2 mbs 1"][1].startswith("– layout.tp: DeepSpeed's tensor parallelism (AutoTP)")
    assert by_row["tp2 pp2 mbs 1"][2] == "failed"
    assert by_row["tp2 dp2 sp mbs 1"][1].startswith("– layout.sequence_parallel:")
    md = open(write_report(summary, str(tmp_path))["markdown"]).read()
    assert "## Layouts by engine" in md and "## Where the step goes" in md
    assert "| own dp4 | not measured | not measured |" in md  # the fake records carry no breakdown
    assert "## Memory census" in md and md.count("| not measured | not measured | not measured | not measured |") >= 7


def test_precision_policy_is_stated_once_and_an_engine_that_differs_is_flagged(tmp_path):
    cs = parse_compare_spec(compare_raw([{"engine": "fsdp"}, {"engine": "deepspeed", "zero_stage": 1}]))
    results = {r.label: ("ok", REF, {}) for r in cs.runs}
    launch = fake_launcher(results)

    def odd_launch(spec, **kw):  # an engine claiming another policy than the workload's
        rec = launch(spec, **kw)
        if kw["point_key"] == "deepspeed ZeRO-1":
            rec["metrics"]["engine"]["precision_policy"] = "bf16 something else"
        rec["metrics"].update(
            parameter_count=2**20,
            activations_saved_bytes=3 * 2**20,
            memory_census={"parameters": {"fp32": 4 * 2**20}, "master_parameters": {}},
        )
        return rec

    summary = run_comparison(cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=odd_launch)
    assert summary["precision_policy"] == POLICY_FP32
    md = open(write_report(summary, str(tmp_path))["markdown"]).read()
    assert md.count("Precision policy") == 1 and POLICY_FP32 not in md  # stated once, from the census
    assert (
        "Precision policy, the same for every run (read from each run's memory census at its first optimizer "
        "step): fp32 parameters. Configured, which no census shows: gradients accumulated over micro-batches "
        "and reduced across data-parallel ranks in fp32." in md
    )
    assert "- deepspeed ZeRO-1: ran another precision policy: bf16 something else" in md
    assert "FSDP2 reshard: ran another" not in md
    assert "| FSDP2 reshard | fp32 4.00 MiB (4.00P) | none | none | none | 3.00 MiB |" in md


def test_matrix_dash_for_a_combination_not_listed(tmp_path):
    """A plain run list: the cell of an engine that cannot run a row's layout is still explained."""
    cs = parse_compare_spec(
        compare_raw(
            [{"engine": "own", "tp": 2, "pp": 2, "dp": 1}, {"engine": "deepspeed", "zero_stage": 1}],
            nproc=4,
            reference=False,
        )
    )
    results = {r.label: ("ok", REF, {}) for r in cs.runs}
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=fake_launcher(results)
    )
    header, rows = layout_matrix(summary)
    by_row = {r[0]: dict(zip(header[1:], r[1:], strict=True)) for r in rows}
    assert by_row["tp2 pp2 mbs 1"]["deepspeed ZeRO-1"].startswith("– layout.tp:")
    assert by_row["dp4 mbs 1"]["own"] == "not run"


# ------------------------------------------------------------------ end to end (real launchers)


def test_planted_seed_difference_fails_comparison_through_cli(tmp_path, cli):
    """Reference + FSDP2 + DeepSpeed ZeRO-1 (deepspeed launcher) with another seed: parity fails,
    the report shows it, the records carry it, the exit code is 1."""
    spec = {
        "name": "planted",
        "nproc": 2,
        "parity_steps": 3,
        "timeout_s": 240,
        "workload": {**WORKLOAD, "steps": 2, "warmup_steps": 1},
        "runs": [
            {"engine": "fsdp", "micro_batch_size": 2},
            {
                "label": "zero1 planted seed",
                "engine": "deepspeed",
                "zero_stage": 1,
                "micro_batch_size": 2,
                "workload": {"seed": 4321},
            },
        ],
    }
    (tmp_path / "cmp.yaml").write_text(yaml.safe_dump(spec))
    store = tmp_path / "r.sqlite"
    r = cli(
        "compare",
        "cmp.yaml",
        "--store",
        str(store),
        "--out",
        str(tmp_path / "reports"),
        "--no-progress",
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "verdict: FAIL" in r.stdout and "parity FAIL: zero1 planted seed" in r.stdout
    md = (tmp_path / "reports" / "compare-planted.md").read_text()
    assert "| FSDP2 reshard | fsdp |" in md
    row = next(line for line in md.splitlines() if line.startswith("| zero1 planted seed |"))
    assert "| ok |" in row and "| FAIL |" in row and "seed=4321" in row
    assert "workload overridden in the compare spec" in md
    every = ResultsStore(str(store)).records()
    drift = [rec for rec in every if (rec.get("sweep") or "").endswith(":load-drift")]  # the reference again
    records = [rec for rec in every if rec not in drift]
    assert len(drift) == 1 and "comparison" not in drift[0]
    assert len(records) == 3 and all(rec["status"] == "ok" for rec in records)
    by_label = {rec["comparison"]["label"]: rec for rec in records}
    assert by_label["FSDP2 reshard"]["comparison"]["parity"]["verdict"] == PASS
    assert by_label["zero1 planted seed"]["comparison"]["parity"]["verdict"] == FAIL
    assert by_label["zero1 planted seed"]["launch"]["launcher"] == "deepspeed"
    assert os.path.isfile(tmp_path / "reports" / "compare-planted.html")
    # DeepSpeed's CPU allreduce leaves a /dev/shm workspace per rank (harness.runtime.teardown unlinks them)
    from harness.runtime import deepspeed_shm_buffers

    cmd = by_label["zero1 planted seed"]["launch"]["command"]
    assert deepspeed_shm_buffers("127.0.0.1", cmd[cmd.index("--master_port") + 1]) == []


def test_a_comparison_report_on_a_full_disk_leaves_the_earlier_one_whole(tmp_path):
    """compare-<name>.md, .html, .json and the figures go in together or not at all."""
    import builtins
    import errno

    cs = parse_compare_spec(compare_raw([{"engine": "fsdp"}]))
    fp = {"hosts": ["n1"], "device_name": "cpu", "torch": "2.13.0"}
    summary = run_comparison(
        cs,
        store_path=str(tmp_path / "r.sqlite"),
        progress=False,
        launch_fn=fake_launcher({"reference (single device)": ("ok", REF, fp), "FSDP2 reshard": ("ok", REF, fp)}),
    )
    out = tmp_path / "out"
    write_report(summary, str(out))
    earlier = {n: f"earlier {n}\n" for n in os.listdir(out) if "." in n}  # the .md, .html and .json
    for name, text in earlier.items():
        (out / name).write_text(text)
    real_open = builtins.open

    def full_disk_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and ".html" in os.path.basename(str(path)):

            def write(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            f.write = write
        return f

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", full_disk_open)
        with pytest.raises(SpecError, match="No space left on device"):
            write_report(summary, str(out))
    assert {n: (out / n).read_text() for n in os.listdir(out) if "." in n} == earlier  # no temporary left either


# ------------------------------------------------------------------ context parallelism (fake launches)

CP_LAYOUTS = [{"dp": 2}, {"cp": 2}, {"cp": 2, "cp_impl": "allgather"}, {"cp": 2, "cp_impl": "ulysses"}]


def test_matrix_has_cp_rows_and_a_refusing_engine_shows_its_reason(tmp_path):
    """cp and cp_impl as a matrix axis: dp derived with cp, a row per implementation, Megatron-core's cells
    a dash with its one-line reason (Transformer Engine); every cell runs or says why, none is 'not run'."""
    raw = {
        "name": "cp",
        "nproc": 2,
        "parity_steps": 2,
        "reference": False,
        "workload": {**WORKLOAD, "seq_len": 64},
        "matrix": {
            "engines": [{"engine": "own", "attention": "naive"}, {"engine": "megatron", "attention": "naive"}],
            "layouts": CP_LAYOUTS,
        },
    }
    cs = parse_compare_spec(raw)
    assert all(r.spec.layout.dp * r.spec.layout.cp == 2 for r in cs.runs)
    megatron = [n for n in cs.not_runnable if n["label"].startswith("megatron")]
    assert [n["label"] for n in megatron] == ["megatron cp2 ring", "megatron cp2 allgather", "megatron cp2 ulysses"]
    assert all(n["why"].startswith("layout.cp: ") and "Transformer Engine" in n["why"] for n in megatron)
    results = {r.label: ("ok", REF, {}) for r in cs.runs}
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=fake_launcher(results)
    )
    header, rows = layout_matrix(summary)
    assert header == ["layout", "own", "megatron"]
    by_row = {r[0]: dict(zip(header[1:], r[1:], strict=True)) for r in rows}
    assert list(by_row) == ["dp2 mbs 1", "cp2 ring mbs 1", "cp2 allgather mbs 1", "cp2 ulysses mbs 1"]
    assert by_row["dp2 mbs 1"]["megatron"].endswith(" pass")
    for impl in ("ring", "allgather", "ulysses"):
        assert by_row[f"cp2 {impl} mbs 1"]["megatron"].startswith("– layout.cp: ")
        own = by_row[f"cp2 {impl} mbs 1"]["own"]
        assert own.endswith(" pass") or own.startswith("– layout.")  # runs, or refuses in one line
    md = open(write_report(summary, str(tmp_path))["markdown"]).read()
    assert "| cp2 ring mbs 1 |" in md and "cp_impl=ring" not in md.split("## Layouts by engine")[1]


def test_an_engines_own_default_is_shown_where_runs_differ_by_it(tmp_path):
    """Megatron-core's attention default (naive, its facts' defaults) differs from the field's (sdpa): the
    differing-fields column shows each run's value, also for a record that does not name the field."""
    from harness.report.compare_layouts import differing_fields, differs_texts

    cs = parse_compare_spec(
        compare_raw([{"engine": "own", "label": "a"}, {"engine": "megatron", "label": "b"}], reference=False)
    )
    assert [r.spec.layout.attention for r in cs.runs] == ["sdpa", "naive"]
    results = {r.label: ("ok", REF, {}) for r in cs.runs}
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=fake_launcher(results)
    )
    assert differing_fields(summary) == ["attention"]
    assert differs_texts(summary) == ["attention=sdpa", "attention=naive"]
    header, rows = layout_matrix(summary)  # one layout, each engine at its own default: one row, no dash
    assert len(rows) == 1 and all(cell.endswith(" pass") for cell in rows[0][1:]), rows
    for run in summary["runs"]:  # records that name only what their spec gave
        run["layout"] = {"engine": run["layout"]["engine"], "dp": run["layout"]["dp"]}
    assert differing_fields(summary) == ["attention"]
    assert differs_texts(summary) == ["attention=sdpa", "attention=naive"]


def test_a_cp_impl_at_cp1_changes_no_row_and_old_records_render_as_before(tmp_path):
    """A run without context parallelism is one row whatever its cp_impl, and a record written before cp
    existed (no cp, no cp_impl) lands in the same row as a new cp1 run, with no cp field shown as differing."""
    cs = parse_compare_spec(
        compare_raw(
            [{"engine": "own", "label": "a"}, {"engine": "fsdp", "label": "b", "cp_impl": "allgather"}], reference=False
        )
    )
    results = {r.label: ("ok", REF, {}) for r in cs.runs}
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=fake_launcher(results)
    )
    header, rows = layout_matrix(summary)
    assert [r[0] for r in rows] == ["dp2 mbs 1"]
    old = json.loads(json.dumps(summary))
    for run in old["runs"]:
        run["layout"] = {k: v for k, v in run["layout"].items() if k not in ("cp", "cp_impl")}
    assert [r[0] for r in layout_matrix(old)[1]] == ["dp2 mbs 1"]
    from harness.report.compare_layouts import differing_fields

    assert not {"cp", "cp_impl"} & set(differing_fields(old))
