"""Outputs people look at: the compare report's loss curves and step-time
distribution, figures that read on a laptop (SVG), axes from zero where a ratio or a throughput
is drawn, whiskers of the interval of the median (at its coverage) on bar charts, the fields that differ
between compared runs, and the per-run TensorBoard stream with its one-line error when the package is missing."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import sys

import pytest
import torch

from harness.cli import main as cli_main
from harness.compare.orchestrate import run_comparison
from harness.compare.spec import parse_compare_spec
from harness.report import analysis, plots
from harness.report.build import sections_for
from harness.report.compare import figures, results_table, write_report
from harness.report.compare_layouts import differing_fields, layout_matrix
from harness.store import ResultsStore
from harness.testing.synthetic import make_records
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload(steps=12, warmup_steps=2)
FP = {"hosts": ["n1"], "device_name": "cpu", "torch": "2.13.0"}


def fake_launcher(step_ms: dict[str, float], seed: int = 0):
    """A stand-in for launch.run_spec: the record a runner writes, with per-step losses (warm-up
    included) and step times (measured steps only) drawn around a given median."""
    rng = random.Random(seed)

    def launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        w = spec["workload"]
        median = step_ms.get(point_key, 10.0) / 1e3
        times = [median * (1 + rng.gauss(0, 0.05)) for _ in range(w["steps"])]
        srt = sorted(times)
        losses = [5.5 - 0.01 * k for k in range(w["warmup_steps"] + w["steps"])]
        rec = {
            "run_id": f"id-{abs(hash(point_key)) % 10**8}",
            "schema_version": 1,
            "status": "ok",
            "error": None,
            "started_at": "t0",
            "ended_at": "t1",
            "sweep": sweep,
            "point_key": point_key,
            "spec": spec,
            "fingerprint": FP,
            "launch": {"launcher": launcher, "log": "x.log", "wall_s": 1.0},
            "metrics": {
                "losses": losses,
                "step_times_s": times,
                "tokens_per_s": 256 / srt[len(srt) // 2],
                "step_time_s": {"median": srt[len(srt) // 2], "ci95_low": srt[2], "ci95_high": srt[-3], "n": len(srt)},
                "peak_memory_bytes": 2**28,
                "memory_kind": "peak_rss",
                "mfu": None,
                "engine": {"optimizer": "AdamW"},
            },
        }
        ResultsStore(store_path).write(rec)
        return rec

    return launch


def summary_of(tmp_path, runs: list[dict], step_ms: dict[str, float] | None = None, **top) -> dict:
    cs = parse_compare_spec(
        {"name": "t", "nproc": 2, "parity_steps": 3, "workload": dict(WORKLOAD), "runs": runs, **top}
    )
    return run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=fake_launcher(step_ms or {})
    )


@pytest.fixture(scope="module")
def sweep_figures():
    """Every figure of a sweep report from synthetic records: (plots function, Figure, SVG bytes)."""
    seen = []
    real = plots._encode

    def keep(fig):
        seen.append((sys._getframe(1).f_code.co_name, fig))
        return real(fig)

    plots._encode = keep
    try:
        images = [img for s in sections_for(make_records(150, seed=3)) for _, img, _ in s.images]
    finally:
        plots._encode = real
    assert len(images) == len(seen)
    return [(kind, fig, img) for (kind, fig), img in zip(seen, images, strict=True)]


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cmp")
    runs = [{"engine": "own", "dp": 2}, {"engine": "deepspeed", "zero_stage": 1}, {"engine": "fsdp"}]
    return summary_of(tmp, runs, {"own dp2": 10.0, "deepspeed ZeRO-1": 10.02, "FSDP2 reshard": 25.0})


# ------------------------------------------------------------------ (a), (b): the two new figures


def test_compare_report_has_loss_curves_and_step_time_distribution(three_runs, tmp_path, drawn):
    paths = write_report(three_runs, str(tmp_path))
    md, page = open(paths["markdown"]).read(), open(paths["html"]).read()
    for name in ("loss-curves", "step-times", "throughput"):
        assert f"](compare-t-img/{name}.svg)" in md  # relative: the report folder can move
        assert (tmp_path / "compare-t-img" / f"{name}.svg").read_bytes().lstrip().startswith(b"<?xml")
        assert re.search(rf"<img id='img-{name}' alt='[^']+' src='data:image/svg\+xml;base64,", page)
    assert md.index("loss-curves.svg") > md.index("## Loss parity")

    kinds = dict(drawn)
    labels = [r["label"] for r in three_runs["runs"]]
    # one line per run, every step of it (warm-up included), the warm-up shaded
    loss_ax = kinds["loss_curves"].axes[0]
    lines = {ln.get_label(): ln for ln in loss_ax.get_lines()}
    assert set(labels) <= set(lines)
    n_steps = WORKLOAD["warmup_steps"] + WORKLOAD["steps"]
    assert all(len(lines[lab].get_xdata()) == n_steps for lab in labels)
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()][-1] == "warm-up"
    # one box per run over its measured steps only (warm-up excluded, as the measurement)
    dist_ax = kinds["distribution"].axes[0]
    assert [t.get_text() for t in dist_ax.get_yticklabels()] == labels
    assert len(dist_ax.collections) >= len(labels)  # the dots: one per measured step
    dots = [c for c in dist_ax.collections if len(c.get_offsets()) == WORKLOAD["steps"]]
    assert len(dots) == len(labels)
    times_ms = sorted(1e3 * t for t in three_runs["runs"][0]["metrics"]["step_times_s"])
    assert sorted(dots[0].get_offsets()[:, 0]) == pytest.approx(times_ms)


def test_a_summary_without_per_step_series_still_reports(three_runs, tmp_path):
    """A summary written before the series were kept: no distribution, loss curve from the table."""
    old = {
        **three_runs,
        "runs": [
            {**r, "metrics": {k: v for k, v in r["metrics"].items() if k != "step_times_s"}} for r in three_runs["runs"]
        ],
    }
    old.pop("loss_curves")
    names = [n for n, _, _ in figures(old)]
    assert names == ["throughput", "loss-curves"]
    assert "step-times" not in open(write_report(old, str(tmp_path))["markdown"]).read()


# ------------------------------------------------------------------ (c): resolution, zero, whiskers


def test_every_figure_is_svg(three_runs, sweep_figures):
    images = [img for _, _, img in sweep_figures] + [img for _, img, _ in figures(three_runs)]
    assert len(images) > 10
    assert plots.FORMAT == "svg" and plots.MIME == "image/svg+xml"
    for img in images:
        head = img[:400].decode()
        assert head.startswith("<?xml") and "<svg" in head


def _value_axis_low(kind: str, ax) -> float:
    return ax.get_ylim()[0] if kind == "lines" else ax.get_xlim()[0]


def test_ratio_and_throughput_axes_start_at_zero(three_runs, sweep_figures, drawn):
    # a 0.2% difference must be drawn as one: two values 0.500 and 0.501
    plots.lines({"a": [(1, 0.500), (2, 0.501)]}, "micro-batch", "MFU", "t", True)
    plots.bars(["a", "b"], [1000.0, 1002.0], "t", "tokens/s", False)
    figures(three_runs)  # the compare report's throughput bars
    every = drawn + [(kind, fig) for kind, fig, _ in sweep_figures]  # and every figure of a sweep report
    checked = [(kind, fig) for kind, fig in every if kind in ("lines", "bars", "stacked")]
    assert {k for k, _ in checked} == {"lines", "bars", "stacked"} and len(checked) > 8
    for kind, fig in checked:
        assert _value_axis_low(kind, fig.axes[0]) == 0, (kind, fig.axes[0].get_title())
    heatmaps = [fig for kind, fig in every if kind == "heatmap"]
    assert heatmaps and all(fig.axes[0].images[0].get_clim()[0] == 0 for fig in heatmaps)  # colours from zero


def _whisker_segments(ax) -> list:
    from matplotlib.container import ErrorbarContainer

    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    return [seg for c in bars for coll in c.lines[2] for seg in coll.get_segments()]


def test_bar_charts_carry_ci_whiskers_from_the_median_ci(three_runs, sweep_figures, drawn):
    figures(three_runs)
    ax = dict(drawn)["bars"].axes[0]
    segs = _whisker_segments(ax)
    assert len(segs) == len(three_runs["runs"])
    for seg, run in zip(segs, three_runs["runs"], strict=True):
        m = run["metrics"]
        st, tps = m["step_time_s"], m["tokens_per_s"]
        # tokens/s at the median step: the CI of the median step time, through 1/x (one definition)
        assert (seg[0][0], seg[1][0]) == pytest.approx(
            (tps * st["median"] / st["ci95_high"], tps * st["median"] / st["ci95_low"])
        )
    assert "interval of the median (" in ax.get_xlabel() and "95% CI" not in ax.get_xlabel()
    # the sweep report's ablation bars and the micro-batch lines carry them too
    for kind in ("bars", "lines"):
        assert all(_whisker_segments(fig.axes[0]) for k, fig, _ in sweep_figures if k == kind)
        assert any(k == kind for k, _, _ in sweep_figures)


def test_step_time_distribution_marks_the_median_ci(three_runs, drawn):
    figures(three_runs)
    ax = dict(drawn)["distribution"].axes[0]
    segs = _whisker_segments(ax)
    run = three_runs["runs"][0]["metrics"]["step_time_s"]
    assert (segs[0][0][0], segs[0][1][0]) == pytest.approx((1e3 * run["ci95_low"], 1e3 * run["ci95_high"]))


# ------------------------------------------------------------------ (d): the fields that differ


def differs_by_run(summary: dict) -> dict[str, str]:
    """The results table's 'Fields that differ' column, by run label."""
    t = results_table(summary)
    col = t.headers.index("Fields that differ")
    return {row[0]: row[col] for row in t.rows}


def test_table_names_the_layout_fields_that_differ(tmp_path):
    summary = summary_of(
        tmp_path,
        [{"engine": "own", "tp": 2, "sequence_parallel": True, "zero_stage": 1}, {"engine": "own", "tp": 2}],
        reference=False,
    )
    assert differing_fields(summary) == ["sequence_parallel", "zero_stage"]
    rows = differs_by_run(summary)
    assert sorted(rows.values()) == ["sequence_parallel=false zero_stage=0", "sequence_parallel=true zero_stage=1"]
    md = open(write_report(summary, str(tmp_path))["markdown"]).read()
    assert "| Fields that differ |" in md and "The runs differ in sequence_parallel, zero_stage;" in md
    assert "sequence_parallel=true zero_stage=1" in md


def test_fields_are_shown_where_they_apply_and_overrides_count(tmp_path):
    summary = summary_of(
        tmp_path,
        [
            {"engine": "own", "dp": 2, "zero_stage": 1},
            {"engine": "fsdp", "reshard_after_forward": False},
            {"engine": "fsdp", "label": "fsdp bf16", "workload": {"precision": "bf16"}},
        ],
    )
    assert differing_fields(summary) == ["dp", "zero_stage", "reshard_after_forward", "workload.precision"]
    rows = differs_by_run(summary)
    assert "reshard_after_forward" not in rows["own ZeRO-1 dp2"]  # FSDP2's knob, not the own engine's
    assert "zero_stage" not in rows["FSDP2 no-reshard"] and "reshard_after_forward=false" in rows["FSDP2 no-reshard"]
    assert "zero_stage=1" in rows["own ZeRO-1 dp2"] and "dp=1" in rows["reference (single device)"]
    assert "workload.precision=bf16" in rows["fsdp bf16"] and "workload.precision=fp32" in rows["own ZeRO-1 dp2"]


def test_matrix_keeps_apart_runs_that_differ_beyond_the_usual_fields(tmp_path):
    """Two own-engine pp2 runs that differ only in the schedule and virtual stages: two rows,
    not one cell overwritten."""
    workload = {**WORKLOAD, "model_overrides": {"layers": 4}}
    cs = parse_compare_spec(
        {
            "name": "t",
            "nproc": 2,
            "parity_steps": 2,
            "reference": False,
            "workload": workload,
            "runs": [
                {"engine": "own", "pp": 2, "label": "1f1b"},
                {
                    "engine": "own",
                    "pp": 2,
                    "label": "interleaved",
                    "virtual_stages": 2,
                    "pipeline_schedule": "interleaved",
                },
            ],
        }
    )
    summary = run_comparison(
        cs,
        store_path=str(tmp_path / "r.sqlite"),
        progress=False,
        launch_fn=fake_launcher({"1f1b": 10.0, "interleaved": 20.0}),
    )
    header, rows = layout_matrix(summary)
    assert header == ["layout", "own"] and len(rows) == 2
    assert {r[0] for r in rows} == {
        "pp2 mbs 1 pipeline_schedule=1f1b virtual_stages=1",
        "pp2 mbs 1 pipeline_schedule=interleaved virtual_stages=2",
    }


# ------------------------------------------------------------------ (e): TensorBoard


def test_tensorboard_stream_holds_every_step_of_rank_0(tmp_path):
    pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from harness.run import run
    from harness.runtime import RunContext
    from harness.spec import parse_spec

    spec = parse_spec(
        {
            "workload": {"seq_len": 32, "global_batch_size": 4, "steps": 3, "warmup_steps": 1},
            "store": str(tmp_path / "r.sqlite"),
        }
    )
    rec = run(
        spec,
        RunContext(0, 1, 0, torch.device("cpu"), None),
        progress=False,
        peak_tflops=1.0,
        tensorboard_dir=str(tmp_path / "tb"),
    )
    run_dir = rec["tensorboard_dir"]
    assert os.path.dirname(run_dir) == str(tmp_path / "tb" / "train") and rec["run_id"][:8] in run_dir
    events = EventAccumulator(run_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "perf/step_time_ms", "perf/tokens_per_s", "perf/mfu_palm", "memory/peak_gib"} <= tags
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [0, 1, 2, 3]  # warm-up included: step 0 is the first
    assert [e.value for e in losses] == pytest.approx(rec["metrics"]["losses"])
    assert all(e.value > 0 for e in events.Scalars("perf/tokens_per_s"))
    assert all(0 < e.value for e in events.Scalars("memory/peak_gib"))
    from harness.report.summary import summary_lines

    assert f"  TensorBoard: {run_dir} (tensorboard --logdir {run_dir})" in summary_lines(rec, "r.sqlite")


@pytest.fixture
def no_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))


def _never(*a, **k):
    raise AssertionError("launched although the tensorboard package is missing")


@pytest.mark.parametrize("command", [["train"], ["compare"], ["sweep", "sweeps/cpu-demo.yaml"]])
def test_missing_tensorboard_is_one_line_and_exit_2_before_launch(
    command, tmp_path, monkeypatch, capsys, no_tensorboard
):
    import harness.compare.orchestrate as orchestrate
    import harness.run as run_module
    import harness.runtime as runtime
    from harness.sweep import execute

    for module, name in (
        (runtime, "init"),
        (run_module, "run"),
        (orchestrate, "run_comparison"),
        (execute, "run_sweep"),
    ):
        monkeypatch.setattr(module, name, _never)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [a if not a.endswith(".yaml") else os.path.join(root, a) for a in command]
    extra = ["--out", str(tmp_path)] if command[0] == "compare" else []
    assert cli_main(argv + ["--store", str(tmp_path / "r.sqlite"), "--tensorboard", str(tmp_path / "tb")] + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --tensorboard: the tensorboard package is not installed; "
        "pip install 'tensorboard>=2.14' (the package's `tensorboard` extra)"
    ]


def test_compare_hands_the_folder_to_every_run(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    import harness.compare.orchestrate as orchestrate
    from harness.measure.stream import TENSORBOARD_ENV

    seen = {}

    def fake(cs, **kw):
        seen["env"] = os.environ.get(TENSORBOARD_ENV)
        raise KeyboardInterrupt

    monkeypatch.setenv(TENSORBOARD_ENV, "")  # restored to what it was (unset) after the test
    monkeypatch.delenv(TENSORBOARD_ENV)
    monkeypatch.setattr(orchestrate, "run_comparison", fake)
    assert (
        cli_main(
            [
                "compare",
                "--store",
                str(tmp_path / "r.sqlite"),
                "--out",
                str(tmp_path),
                "--tensorboard",
                str(tmp_path / "tb"),
            ]
        )
        == 130
    )  # the interrupt, as from a Ctrl-C
    assert seen["env"] == str(tmp_path / "tb")


def test_tensorboard_is_an_optional_extra_and_in_dev():
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    assert extras["tensorboard"] == ["tensorboard>=2.14"]
    assert "tensorboard>=2.14" in extras["dev"]  # CI installs dev: the stream's test runs there
    assert not any("tensorboard" in d for d in project["dependencies"])  # optional


def test_metric_ci_is_the_step_time_ci_through_one_over_x():
    rows = [
        analysis.Row(
            **{
                **_row_defaults(),
                "step_time_median_s": 2.0,
                "step_time_ci95_s": (1.6, 2.5),
                "tokens_per_s_per_device": 100.0,
            }
        )
    ]
    from harness.report.data import choose_metric

    m = choose_metric(rows)
    assert analysis.metric_ci(rows[0], m) == pytest.approx((100 * 2.0 / 2.5, 100 * 2.0 / 1.6))


def _row_defaults() -> dict:
    return dict(
        run_id="r",
        sweep="s",
        status="ok",
        engine="own",
        variant="own",
        label="own",
        model="tiny",
        seq_len=32,
        global_batch_size=8,
        precision="fp32",
        gpus=1,
        tp=1,
        pp=1,
        dp=1,
        micro_batch_size=1,
        activation_checkpointing="none",
        sequence_parallel=False,
        attention="sdpa",
        rmsnorm="torch",
        zero_stage=0,
    )
