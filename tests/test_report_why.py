"""Reports: where the step goes for every engine (breakdown_ms), collectives per step,
links to the kept traces, and a Why section whose sentences name the component that explains a
step-time difference with its numbers; the same for sweeps and their ablations. Synthetic records
and a comparison summarised from a stand-in launcher: no processes."""

from __future__ import annotations

import json

import pytest
from conftest import profiled_record

from harness.compare.orchestrate import run_comparison
from harness.compare.spec import parse_compare_spec
from harness.report.build import sections_for
from harness.report.compare import sections, write_report
from harness.report.compare_steps import BREAKDOWN_AXIS, COLLECTIVES_TEXT, breakdown_rows, collective_rows
from harness.report.data import breakdown_of, layout_key
from harness.report.why import Case, comparisons, explain
from harness.store import ResultsStore
from harness.testing.synthetic import make_records
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload(steps=4)
RUNS = [
    {"engine": "own", "tp": 2},
    {"engine": "fsdp", "tp": 2},
    {"engine": "own", "dp": 2},
    {"engine": "deepspeed", "zero_stage": 1},
]


def bd(step, compute, optimizer, other, bubble=0.0, **comm) -> dict:
    return {
        "compute": compute,
        "optimizer": optimizer,
        "exposed_comm": comm,
        "bubble": bubble,
        "other": other,
        "step": step,
    }


# Per (engine, tp): the profiled breakdown (ms), the collectives; the answers below follow from these.
PROFILED = {
    ("own", 2): bd(100.0, 70.0, 10.0, 10.0, tp=10.0),
    ("fsdp", 2): bd(141.0, 78.1, 10.0, 12.7, tp=40.2),
    ("own", 1): bd(90.0, 72.0, 10.0, 5.0, dp=3.0),
    ("deepspeed", 1): bd(120.0, 73.0, 12.0, 5.0, dp=30.0),
}
COLLECTIVES = {
    ("fsdp", 2): [{"axis": "tp", "kind": "all_reduce", "count": 24, "bytes": 3 * 2**20}],
    ("deepspeed", 1): [{"axis": "dp", "kind": "all_reduce", "count": 4, "bytes": 2**21}],
}


def launcher(old: bool = False):
    """A stand-in for launch.run_spec writing a runner's record: with the profiler's fields, or
    (old) with only what records had before them: breakdown_s and comm for the own engine,
    forward_backward for FSDP2, nothing for DeepSpeed and the reference."""

    def launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        lay = spec["layout"]
        key = (lay["engine"], lay.get("tp", 1))
        b = PROFILED.get(key)
        median = b["step"] / 1e3 if b else 0.2
        m = {
            "losses": [5.0 - 0.01 * k for k in range(5)],
            "step_times_s": [median] * 4,
            "step_time_s": {"median": median, "ci95_low": median, "ci95_high": median, "n": 4},
            "tokens_per_s": 256 / median,
            "engine": {},
        }
        rec = {
            "run_id": f"id-{point_key}",
            "schema_version": 1,
            "status": "ok",
            "error": None,
            "sweep": sweep,
            "point_key": point_key,
            "spec": spec,
            "fingerprint": {"hosts": ["n1"], "torch": "2.13.0"},
            "launch": {"launcher": launcher, "log": "x.log", "wall_s": 1.0},
            "metrics": m,
        }
        if old and key[0] == "own":
            s = {k: v / 1e3 for k, v in b.items() if k in ("compute", "optimizer", "bubble")}
            m["breakdown_s"] = {
                **s,
                **{f"{a}_comm": v / 1e3 for a, v in b["exposed_comm"].items()},
                "total": b["step"] / 1e3,
            }
            m["comm"] = {"tp": {"all_reduce": {"count": 12, "bytes": 2**20}}} if key[1] == 2 else {}
        elif old and key[0] == "fsdp":
            m["breakdown_s"] = {"forward_backward": 0.12, "optimizer": 0.01, "total": 0.141}
        elif not old and b:
            m.update(breakdown_ms=b, breakdown_source="profiler", collectives=COLLECTIVES.get(key, []))
            rec["traces"] = [
                {"rank": 0, "path": f"traces/{point_key}-rank0.json.gz", "role": "rank 0"},
                {"rank": 1, "path": f"traces/{point_key}-rank1.json.gz", "role": "slowest rank"},
            ]
        ResultsStore(store_path).write(rec)
        return rec

    return launch


def summarise(tmp_path, old: bool = False) -> dict:
    cs = parse_compare_spec({"name": "t", "nproc": 2, "parity_steps": 3, "workload": dict(WORKLOAD), "runs": RUNS})
    return run_comparison(cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=launcher(old))


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    return summarise(tmp_path_factory.mktemp("why"))


@pytest.fixture(scope="module")
def report(summary, tmp_path_factory):
    paths = write_report(summary, str(tmp_path_factory.mktemp("out")))
    return {k: open(p).read() for k, p in paths.items() if k != "images"}


# The sentences the data above implies (the fastest run: own dp2 at 90 ms).
FSDP_VS_OWN_TP2 = (
    "FSDP2 reshard tp2 takes 41.0 ms more per measured step than own tp2 (median 141.0 against 100.0 ms; "
    "ratio 1.410x [1.410, 1.410] (97.1%)); "
    "by the breakdowns (141.0 against 100.0 ms): exposed tp communication +30.2 ms (74% of the difference), "
    "compute +8.1 ms (20% of the difference)."
)
DS_VS_OWN_DP2 = (
    "deepspeed ZeRO-1 takes 30.0 ms more per measured step than own dp2 (median 120.0 against 90.0 ms; "
    "ratio 1.333x [1.333, 1.333] (97.1%)); "
    "by the breakdowns (120.0 against 90.0 ms): exposed dp communication +27.0 ms (90% of the difference)."
)
OWN_TP2_VS_DP2 = (
    "own tp2 takes 10.0 ms more per measured step than own dp2 (median 100.0 against 90.0 ms; ratio 1.111x "
    "[1.111, 1.111] (97.1%)); by the breakdowns (100.0 against 90.0 ms): exposed tp communication +10.0 ms "
    "(100% of the difference), host overhead and other +5.0 ms (50% of the difference); partly offset by "
    "exposed dp communication -3.0 ms, compute -2.0 ms."
)


def test_why_sentences_name_the_component_with_its_numbers(summary, report):
    why = next(s for s in sections(summary, []) if s.id == "why")
    items = [i for b in why.body if hasattr(b, "items") for i in b.items]
    assert items.index(DS_VS_OWN_DP2) < items.index(FSDP_VS_OWN_TP2)  # the fastest run's layout first
    assert OWN_TP2_VS_DP2 in items
    assert "Fastest run (measured median): **own dp2**." in why.body
    for fmt in ("markdown", "html"):
        assert "exposed tp communication +30.2 ms (74% of the difference)" in report[fmt]
        assert "exposed dp communication +27.0 ms (90% of the difference)" in report[fmt]


def case(label, median_ms, ci_ms=None, engine="own", layout="x", **parts):
    """A run as Why sees it: its measured median (and CI) in ms, its breakdown's parts in ms."""
    comm = {a: parts.pop(a) for a in ("tp", "cp", "dp", "pp") if a in parts}
    b = breakdown_of(
        {"breakdown_measured_ms": {**parts, "exposed_comm": comm, "step": sum([*parts.values(), *comm.values()])}}
    )
    ci = (ci_ms[0] / 1e3, ci_ms[1] / 1e3) if ci_ms else None
    return Case(label, engine, layout, median_ms / 1e3, b, ci)


def test_the_slower_run_by_measured_median_is_named_first_whatever_the_order_given():
    a, b = case("a", 60.0, compute=50.0, optimizer=10.0), case("b", 54.0, compute=45.0, optimizer=9.0)
    expected = (
        "a takes 6.0 ms more per measured step than b (median 60.0 against 54.0 ms); by the breakdowns "
        "(60.0 against 54.0 ms): compute +5.0 ms (83% of the difference), optimizer +1.0 ms (17% of the difference)."
    )
    assert explain(a, b) == expected and explain(b, a) == expected


def test_a_difference_inside_the_confidence_intervals_is_not_distinguishable():
    """ZeRO-1 16.8 ms [15.4, 22.9] against ZeRO-2 22.2 ms [13.7, 30.7] (the committed default report):
    the intervals overlap, so nothing is explained, whatever the breakdowns say."""
    z1 = case("deepspeed ZeRO-1", 16.8, (15.4, 22.9), compute=10.0, dp=6.8)
    z2 = case("deepspeed ZeRO-2", 22.2, (13.7, 30.7), compute=10.0, dp=12.2)
    assert explain(z2, z1) == (
        "deepspeed ZeRO-2 (22.2 ms [13.7, 30.7]) and deepspeed ZeRO-1 (16.8 ms [15.4, 22.9]): not distinguishable "
        "(the intervals of the median step overlap); nothing to explain."
    )
    assert "not distinguishable" not in explain(z1, case("slow", 40.0, (31.0, 45.0), compute=10.0, dp=30.0))


def test_no_share_above_100_percent_or_below_0_is_printed_as_an_explanation():
    """The same compute, components moving both ways by more than the 2 ms between the breakdowns
    (the committed report printed 485% for ZeRO-1 against ZeRO-2): no share at all."""
    fast = case("deepspeed ZeRO-1", 20.0, (19.5, 20.5), compute=10.0, dp=2.0, wait=6.0, optimizer=2.0)
    slow = case("deepspeed ZeRO-2", 22.0, (21.5, 22.5), compute=10.0, dp=10.0, wait=0.0, optimizer=2.0)
    text = explain(fast, slow)
    assert text == (
        "deepspeed ZeRO-2 takes 2.0 ms more per measured step than deepspeed ZeRO-1 (median 22.0 against 20.0 ms); "
        "the components moved both ways, by more than the 2.0 ms between the breakdowns (22.0 against 20.0 ms): "
        "exposed dp communication +8.0 ms, waiting for other ranks -6.0 ms; no share of the difference is any one "
        "component's."
    ), text
    assert (
        "% of the difference" not in text
        and "dp communication +8.0 ms" in text
        and "waiting for other ranks -6.0 ms" in text
    )
    # and where every named component lies in (0, 100%], each share is printed
    ok = explain(fast, case("b", 23.0, (22.5, 23.5), compute=11.0, dp=4.0, wait=6.0, optimizer=2.0))
    assert "compute +1.0 ms (33% of the difference)" in ok and "dp communication +2.0 ms (67%" in ok, ok
    shares = [int(x.split("% of")[0].split("(")[-1]) for x in ok.split("ms (")[1:] if "% of" in x]
    assert shares and all(0 < x <= 100 for x in shares), ok


def test_why_never_contradicts_the_measured_order():
    """FSDP2 reshard measured slower than deepspeed ZeRO-2 but with a shorter breakdown sum: the
    sentence says ZeRO-2 is the faster (the measured call) and explains nothing (before: 'FSDP2
    reshard takes 17.1 ms less per profiled step than deepspeed ZeRO-2' beside 'Fastest run:
    deepspeed ZeRO-2')."""
    z2 = case("deepspeed ZeRO-2", 30.0, (29.5, 30.2), compute=12.0, dp=17.0, optimizer=3.0)
    fsdp = case("FSDP2 reshard", 31.0, (30.5, 31.5), compute=14.0, dp=10.0, optimizer=5.5)
    text = explain(fsdp, z2)
    assert text.startswith("FSDP2 reshard takes 1.0 ms more per measured step than deepspeed ZeRO-2"), text
    assert "not explained: the breakdowns differ by -2.5 ms, the other way" in text and "less" not in text


def test_a_breakdown_off_its_measured_median_is_not_used():
    """own pp2: 18.8 ms profiled against 10.7 ms measured (committed report): named, not explained."""
    pp2 = case("own pp2", 10.7, (9.7, 10.9), compute=8.3, bubble=9.7, optimizer=0.8)
    dp2 = case("own dp2", 15.4, (15.0, 15.8), compute=10.0, dp=4.0, optimizer=1.4)
    assert explain(pp2, dp2) == (
        "own dp2 takes 4.7 ms more per measured step than own pp2 (median 15.4 against 10.7 ms); not explained: "
        "own pp2's breakdown describes a 18.8 ms step against its measured median 10.7 ms (off by more than 10%)."
    )


def test_within_a_layout_every_framework_is_also_explained_against_the_own_engine():
    """The fastest engine of a layout is the first yardstick; the own engine, when it is not the fastest,
    the second: FSDP2 tp2 against own tp2 is explained even where DeepSpeed tp2 measured fastest."""

    def case(label, engine, step_s, **parts):
        return Case(
            label, engine, "tp2", step_s, breakdown_of({"breakdown_ms": {**parts, "step": sum(parts.values())}})
        )

    ds, own = (
        case("deepspeed tp2", "deepspeed", 0.090, compute=34.0, tp=56.0),
        case("own tp2", "own", 0.094, compute=32.0, tp=62.0),
    )
    fsdp = case("FSDP2 tp2", "FSDP2 reshard", 0.150, compute=86.0, tp=64.0)
    same_layout, _ = comparisons([fsdp, own, ds])
    assert [s.split(" takes ")[0] + " / " + s.split(" than ")[1].split(" (")[0] for s in same_layout] == [
        "own tp2 / deepspeed tp2",
        "FSDP2 tp2 / deepspeed tp2",
        "FSDP2 tp2 / own tp2",
    ]
    assert same_layout[2] == (
        "FSDP2 tp2 takes 56.0 ms more per measured step than own tp2 (median 150.0 against 94.0 ms); by the "
        "breakdowns (150.0 against 94.0 ms): compute +54.0 ms (96% of the difference)."
    ), same_layout[2]


def test_where_the_step_goes_for_every_engine_in_ms_and_percent(summary, report):
    header, rows = breakdown_rows(summary)
    assert header == [
        "run",
        "source",
        "compute",
        "exposed tp communication",
        "exposed dp communication",
        "waiting for other ranks",  # no run here has a pipeline: no bubble (the records' 'bubble' at pp 1)
        "optimizer",
        "host overhead and other",
        "step",
        "measured median",
        "clocked share of the median",
    ]
    by = {r[0]: r for r in rows}
    assert by["FSDP2 reshard tp2"] == [
        "FSDP2 reshard tp2",
        "profiler",
        "78.1 ms (55%)",
        "40.2 ms (29%)",
        "-",
        "0.0 ms (0%)",
        "10.0 ms (7%)",
        "12.7 ms (9%)",
        "141.0 ms",
        "141.0 ms",
        "100%",  # these synthetic parts are all clocked; nothing closes the sum (next test: it can fail)
    ]
    assert by["deepspeed ZeRO-1"][3:5] == ["-", "30.0 ms (25%)"]
    assert set(by["reference (single device)"][1:-2]) == {"not measured"}  # a run with no breakdown at all
    assert by["reference (single device)"][-2:] == ["200.0 ms", "-"]
    for fmt in ("markdown", "html"):
        assert "40.2 ms (29%)" in report[fmt] and "exposed dp communication" in report[fmt]


def test_collectives_and_trace_links(summary, report):
    _, rows = collective_rows(summary)
    assert ["FSDP2 reshard tp2", "profiler", "tp", "all_reduce", "24", "3.00 MiB"] in rows
    assert ["deepspeed ZeRO-1", "profiler", "dp", "all_reduce", "4", "2.00 MiB"] in rows
    assert ["own tp2", "profiler", "-", "none", "0", "-"] in rows
    md, page = report["markdown"], report["html"]
    for text in (md, page):
        assert "ui.perfetto.dev" in text and "chrome://tracing" in text
    (own_dp2,) = [line for line in md.splitlines() if line.startswith("- **own dp2**: ")]
    # the records' trace files are not on disk: no link into a folder the report does not carry (trace links
    # only to copies beside it;
    # tests/test_report_truth.py checks the copies beside the report)
    assert own_dp2 == "- **own dp2**: 2 trace file(s) not kept beside this report (not linked)", own_dp2
    assert "**reference (single device)**: no trace kept" in md


def test_compare_json_carries_the_breakdown_fields(summary, report):
    runs = {r["label"]: r for r in json.loads(report["json"])["runs"]}
    fsdp = runs["FSDP2 reshard tp2"]
    assert fsdp["breakdown_ms"] == PROFILED[("fsdp", 2)] and fsdp["breakdown_source"] == "profiler"
    assert fsdp["collectives"] == COLLECTIVES[("fsdp", 2)]
    assert fsdp["traces"][1] == {"rank": 1, "path": "traces/FSDP2 reshard tp2-rank1.json.gz", "role": "slowest rank"}
    ref = runs["reference (single device)"]
    assert {k: ref[k] for k in ("breakdown_ms", "breakdown_source", "collectives")} == {
        "breakdown_ms": None,
        "breakdown_source": None,
        "collectives": None,
    }


def test_old_records_without_breakdown_ms_still_render(tmp_path):
    summary = summarise(tmp_path, old=True)
    paths = write_report(summary, str(tmp_path / "out"))
    md, page = open(paths["markdown"]).read(), open(paths["html"]).read()
    header, rows = breakdown_rows(summary)
    by = {r[0]: dict(zip(header, r, strict=True)) for r in rows}
    assert by["own tp2"]["source"] == "instrumented" and by["own tp2"]["compute"] == "70.0 ms (70%)"
    # what the total leaves uncovered: not clocked (apart), no longer 'host overhead and other', a component
    assert by["own tp2"]["not clocked (the step less its clocked parts)"] == "10.0 ms (10%)"
    assert "host overhead and other" not in header and by["own tp2"]["clocked share of the median"] == "90%"
    assert by["FSDP2 reshard tp2"]["forward+backward (compute and comm not split)"] == "120.0 ms (85%)"
    assert set(list(by["deepspeed ZeRO-1"].values())[1:-2]) == {"not measured"}
    assert by["own tp2"]["waiting for other ranks"] == "0.0 ms (0%)" and "pipeline bubble" not in header
    _, coll = collective_rows(summary)
    assert ["own tp2", "instrumented", "tp", "all_reduce", "12", "1.00 MiB"] in coll
    assert "own tp2 takes 10.0 ms more per measured step than own dp2" in md
    assert "own tp2 takes 10.0 ms more per measured step than own dp2" in page


# ------------------------------------------------------------------ sweeps


def sweep_record(step, layout, parts) -> dict:
    lay = {
        "engine": "own",
        "tp": 1,
        "pp": 1,
        "dp": 2,
        "micro_batch_size": 1,
        "activation_checkpointing": "none",
        **layout,
    }
    spec = {"workload": {"model": "tiny", "seq_len": 32, "global_batch_size": 8}, "layout": lay}
    return profiled_record(spec, step, parts, 4, 1e3 / step, sweep="s", point_key=json.dumps(layout))


SWEEP = [
    sweep_record(100.0, {"tp": 2}, {"compute": 70.0, "exposed_comm": {"tp": 20.0, "dp": 5.0}, "optimizer": 5.0}),
    sweep_record(
        90.0, {"pp": 2}, {"compute": 70.0, "exposed_comm": {"pp": 2.0, "dp": 5.0}, "bubble": 10.0, "optimizer": 3.0}
    ),
    sweep_record(
        120.0,
        {"pp": 2, "activation_checkpointing": "full"},
        {"compute": 100.0, "exposed_comm": {"pp": 2.0, "dp": 5.0}, "bubble": 10.0, "optimizer": 3.0},
    ),
    sweep_record(
        95.0,
        {"pp": 2, "micro_batch_size": 2},
        {"compute": 68.0, "exposed_comm": {"pp": 2.0, "dp": 5.0}, "bubble": 17.0, "optimizer": 3.0},
    ),
    sweep_record(
        110.0,
        {"engine": "deepspeed", "dp": 4, "zero_stage": 1},
        {"compute": 70.0, "exposed_comm": {"dp": 30.0}, "optimizer": 5.0, "other": 5.0},
    ),
]


def test_sweep_ablations_name_the_component_that_moved():
    texts = {s.id: " ".join(s.text) for s in sections_for(SWEEP)}
    assert "takes 10.0 ms more per measured step than tp1 pp2 (own tp1 pp2 dp2 mb1" in texts["tp-pp"]
    # tp communication +20 ms against a 10 ms difference: the deltas, and no share (before: '200% of the difference')
    assert (
        "the components moved both ways, by more than the 10.0 ms between the breakdowns (100.0 against 90.0 ms): "
        "exposed tp communication +20.0 ms, pipeline bubble -10.0 ms, pipeline transfers -2.0 ms, optimizer "
        "+2.0 ms; no share of the difference is any one component's."
    ) in texts["tp-pp"]
    assert "takes 30.0 ms more per measured step than checkpointing none" in texts["checkpointing"]
    assert "(120.0 against 90.0 ms): compute +30.0 ms (100% of the difference)." in texts["checkpointing"]
    assert "micro-batch 2 (own tp1 pp2 dp2 mb2" in texts["micro-batch"]
    assert "pipeline bubble +7.0 ms, compute -2.0 ms; no share" in texts["micro-batch"]  # before: 140%
    assert "% of the difference" not in texts["tp-pp"] + texts["micro-batch"]
    assert "no run with the same other settings" not in texts["checkpointing"] + texts["micro-batch"]


def test_sweep_breakdown_covers_every_engine_per_point():
    s = next(s for s in sections_for(SWEEP) if s.id == "breakdown")
    (t,) = s.tables
    rows = {r[0].split()[0]: dict(zip(t.headers, r, strict=True)) for r in t.rows}
    assert rows["deepspeed"]["exposed dp communication"] == "30.0 ms (27%)"
    assert rows["deepspeed"]["source"] == "profiler" and len(t.rows) == len(SWEEP)
    why = " ".join(s.text)
    assert "takes 10.0 ms more per measured step than own tp1 pp2" in why


# ------------------------------------------------------------------ figures and synthetic records


def test_every_breakdown_figure_is_drawn_from_zero(summary, tmp_path, drawn):
    write_report(summary, str(tmp_path))
    sections_for(SWEEP + make_records(60, seed=4))
    stacks = [fig for kind, fig in drawn if kind == "stacked"]
    assert len(stacks) >= 2  # the comparison's and at least one sweep's
    for fig in stacks:
        ax = fig.axes[0]
        assert ax.get_xlim()[0] == 0 and min(p.get_x() for p in ax.patches) == 0
    compare_fig = stacks[0].axes[0]
    assert {t.get_text() for t in compare_fig.get_yticklabels()} >= {"own tp2", "FSDP2 reshard tp2"}
    assert "exposed tp communication" in [t.get_text() for t in compare_fig.get_legend().get_texts()]
    # the axis says what the numbers are (before: 'ms per step (median)' under profiled steps' means)
    assert compare_fig.get_xlabel() == BREAKDOWN_AXIS and "mean over ranks" in BREAKDOWN_AXIS


def _with_run(summary: dict, label: str, **changes) -> dict:
    """The summary with one run's metrics changed (a copy)."""
    runs = []
    for r in summary["runs"]:
        if r["label"] == label:
            r = {**r, "metrics": {**r["metrics"], **changes}}
            for k in changes:  # the summary's own copy of a field (orchestrate._run_entry) would win
                r.pop(k, None)
        runs.append(r)
    return {**summary, "runs": runs}


def test_a_breakdown_off_its_median_is_flagged_with_both_numbers(summary):
    """own pp2 in the committed default report: 18.8 ms profiled against 10.7 ms measured, unflagged."""
    stats = {"median": 0.0107, "ci95_low": 0.0097, "ci95_high": 0.0153, "n": 8}
    off = _with_run(summary, "own tp2", step_time_s=stats, breakdown_ms=bd(18.8, 8.3, 0.8, 0.0, 9.7, tp=0.0))
    header, rows = breakdown_rows(off)
    row = dict(zip(header, next(r for r in rows if r[0] == "own tp2"), strict=True))
    assert (row["step"], row["measured median"]) == ("18.8 ms", "10.7 ms")
    assert row["clocked share of the median"] == (
        "176%; its step 176% of the median (off by more than 10%), not used by Why"
    )
    fsdp = dict(zip(header, next(r for r in rows if r[0] == "FSDP2 reshard tp2"), strict=True))
    assert fsdp["clocked share of the median"] == "100%"
    why = next(s for s in sections(off, []) if s.id == "why")
    items = [i for b in why.body if hasattr(b, "items") for i in b.items]
    assert any("own tp2's breakdown describes a 18.8 ms step against its measured median 10.7 ms" in i for i in items)
    assert not any("own tp2" in i and "% of the difference" in i for i in items), items


def test_the_harness_loss_reduction_is_not_listed_as_the_engines(summary):
    coll = [{"axis": "harness", "kind": "all_reduce", "count": 1.0, "bytes": 4.0}] + COLLECTIVES[("fsdp", 2)]
    _, rows = collective_rows(_with_run(summary, "FSDP2 reshard tp2", collectives=coll))
    mine = [r for r in rows if r[0] == "FSDP2 reshard tp2"]
    assert mine == [["FSDP2 reshard tp2", "profiler", "tp", "all_reduce", "24", "3.00 MiB"]]
    alone = _with_run(summary, "FSDP2 reshard tp2", collectives=coll[:1])
    assert ["FSDP2 reshard tp2", "profiler", "-", "none", "0", "-"] in collective_rows(alone)[1]
    assert "harness's own loss reduction" in COLLECTIVES_TEXT


def test_a_group_of_one_rank_says_so(summary):
    """Megatron at dp2 reduces over its tensor-parallel and model-parallel groups of one rank each
    (before: 'other all_reduce 7.0'): named as the groups they are, and as holding one rank."""
    coll = [
        {"axis": "tp", "kind": "all_reduce", "count": 6.0, "bytes": 24.0},
        {"axis": "tp+pp", "kind": "all_reduce", "count": 1.0, "bytes": 4.0},
        {"axis": "dp", "kind": "all_reduce", "count": 1.0, "bytes": 2.0**20},
    ]
    _, rows = collective_rows(_with_run(summary, "deepspeed ZeRO-1", collectives=coll))  # dp2
    assert [r[2] for r in rows if r[0] == "deepspeed ZeRO-1"] == ["tp (one rank)", "tp+pp (one rank)", "dp"]


def test_own_and_megatron_at_the_same_layout_are_paired():
    """Both with naive attention at pp2: the same layout, so Why sets one against the other."""
    base = {"tp": 1, "pp": 2, "dp": 1, "micro_batch_size": 2, "attention": "naive"}
    own, meg = {"engine": "own", **base}, {"engine": "megatron", **base}
    assert layout_key(own) == layout_key(meg)
    cases = [
        Case(
            "own pp2 naive",
            "own",
            layout_key(own),
            0.020,
            breakdown_of({"breakdown_measured_ms": bd(20.0, 12.0, 1.0, 0.0, 7.0)}),
            (0.019, 0.021),
        ),
        Case(
            "megatron pp2",
            "megatron",
            layout_key(meg),
            0.030,
            breakdown_of({"breakdown_measured_ms": bd(30.0, 20.0, 2.0, 0.0, 8.0)}),
            (0.029, 0.031),
        ),
    ]
    engines, _ = comparisons(cases)
    assert engines == [
        "megatron pp2 takes 10.0 ms more per measured step than own pp2 naive (median 30.0 against 20.0 ms); by the "
        "breakdowns (30.0 against 20.0 ms): compute +8.0 ms (80% of the difference), pipeline bubble +1.0 ms (10% "
        "of the difference), optimizer +1.0 ms (10% of the difference)."
    ]


def test_synthetic_records_carry_the_profiler_fields_for_every_engine():
    ok = [r for r in make_records(80, seed=1) if r["status"] == "ok"]
    assert {r["spec"]["layout"]["engine"] for r in ok} == {"own", "deepspeed", "fsdp"}
    for r in ok:
        m = r["metrics"]
        b = m["breakdown_ms"]
        total = b["compute"] + b["optimizer"] + b["bubble"] + b["other"] + sum(b["exposed_comm"].values())
        assert total == pytest.approx(b["step"], abs=1e-2) and b["other"] >= 0
        assert m["breakdown_source"] == "profiler"
        assert all(set(c) == {"axis", "kind", "count", "bytes"} for c in m["collectives"])
        assert [t["role"] for t in r["traces"]] == ["rank 0", "slowest rank"]
        assert layout_key(r["spec"]["layout"])


def test_odd_breakdown_fields_read_as_far_as_they_go():
    b = breakdown_of({"breakdown_ms": {"compute": None, "exposed_comm": 5, "optimizer": 2.0, "step": 10.0}})
    assert b.parts == {"optimizer": 2.0} and b.step_ms == 10.0 and b.source == "profiler"
    assert breakdown_of({"breakdown_s": {}}) is None and breakdown_of(None) is None
