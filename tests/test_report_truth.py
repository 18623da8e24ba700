"""A comparison report states cores, processes and threads per run and keeps
oversubscribed runs out of ranking and Why; a reader can reproduce a run from the report (command,
versions, spec, resolved engine settings, trace links that exist); the JSON and the sweep report say
what the Markdown says. Summaries built by a stand-in launcher (tests/test_report_plots.fake_launcher):
no process starts."""

from __future__ import annotations

import json

import pytest
from test_report_plots import summary_of

from harness.report.compare import sections
from harness.report.compare_machine import machine_table, oversubscribed, run_threads, timed_runs
from harness.report.drift import compare_with_baseline
from harness.report.render import markdown


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    """Two 2-process runs and the reference on a machine of 2 cores, then the same on one core."""
    runs = [{"engine": "own", "dp": 2}, {"engine": "own", "tp": 2}]
    s = summary_of(tmp_path_factory.mktemp("c"), runs, {"own dp2": 10.0, "own tp2": 30.0})
    for r in s["runs"]:
        r["fingerprint"] = {**r["fingerprint"], "device_type": "cpu", "cpu_cores": 2, "env": {"OMP_NUM_THREADS": "1"}}
    return s


def _one_core(summary: dict) -> dict:
    import copy

    s = copy.deepcopy(summary)
    for r in s["runs"]:
        r["fingerprint"]["cpu_cores"] = 1
    return s


def test_a_run_with_more_busy_threads_than_cores_is_oversubscribed(crowded):
    t = run_threads(crowded["runs"][1], crowded)
    assert (t.cores, t.procs, t.threads, t.busy, t.oversubscribed) == (2, 2, 1, 2, False)
    one = _one_core(crowded)
    assert [oversubscribed(r, one) for r in one["runs"]] == [False, True, True]  # the reference runs 1 thread
    assert timed_runs(one) == []
    four = _one_core(crowded)
    for r in four["runs"]:
        r["fingerprint"].update(cpu_cores=4, env={"OMP_NUM_THREADS": "3"})
    assert [oversubscribed(r, four) for r in four["runs"]] == [False, True, True]  # 2 x 3 > 4
    gpu = _one_core(crowded)
    for r in gpu["runs"]:
        r["fingerprint"]["device_type"] = "cuda"  # a GPU run's host threads mostly wait
    assert not any(oversubscribed(r, gpu) for r in gpu["runs"])


def test_the_report_states_cores_processes_and_threads_per_run(crowded):
    table = machine_table(crowded)
    assert table.headers[:5] == ["run", "usable cores", "processes (per host)", "threads per process", "busy threads"]
    assert table.rows[1] == ["own dp2", "2", "2", "1", "2", "no"]
    md = markdown("t", sections(crowded, figs=[]), "img")
    assert "## Cores, processes and threads" in md
    assert "so that step times compare layouts rather than thread counts" in md  # true here: nobody oversubscribed


def test_oversubscribed_runs_are_marked_and_neither_ranked_nor_explained(crowded):
    md = markdown("t", sections(_one_core(crowded), figs=[]), "img")
    assert "so that step times compare layouts rather than thread counts" not in md  # false when oversubscribed
    assert "| own dp2 | 1 | 2 | 1 | 2 | oversubscribed |" in md
    why = md[md.index("## Why") :]
    why = why[: why.index("\n## ", 5)]
    assert "Not ranked or explained (oversubscribed" in why and "own dp2, own tp2" in why
    assert "takes" not in why and "Fastest run" not in why  # no ranking, no explanation
    assert "(oversubscribed)" in md[md.index("## Layouts by engine") :]  # the matrix cell is marked
    assert "loss parity holds" in md  # parity still counts every run
    assert "oversubscribed: times not ranked" in md  # the table of runs says it too


def test_a_baseline_check_leaves_oversubscribed_step_times_out(crowded):
    assert compare_with_baseline(crowded, _slower(crowded), 0.1)["drifts"]  # 3x slower: a drift
    assert compare_with_baseline(crowded, _one_core(_slower(crowded)), 0.1)["drifts"] == []  # oversubscribed now


def _slower(summary: dict) -> dict:
    import copy

    s = copy.deepcopy(summary)
    for r in s["runs"]:
        if r["label"] == "own tp2":
            st = r["metrics"]["step_time_s"]
            r["metrics"]["step_time_s"] = {k: (3 * v if k not in ("n", "ci_coverage") else v) for k, v in st.items()}
            if r["metrics"].get("step_times_s"):  # the baseline check compares every step where it has them
                r["metrics"]["step_times_s"] = [3 * t for t in r["metrics"]["step_times_s"]]
    return s


# ------------------------------------------------------------------ item 8: reproduce a run from its report


def test_the_json_holds_each_runs_command_spec_and_the_versions(crowded):
    from harness.store.record import harness_version

    run = crowded["runs"][1]
    assert run["spec"]["layout"]["dp"] == 2 and run["spec"]["workload"]["seq_len"] == crowded["workload"]["seq_len"]
    assert "command" in run  # the launcher's command as the record keeps it (None from this stand-in launcher)
    import os

    from harness.resources import source_root

    assert crowded["versions"] == harness_version()
    if source_root() is not None and os.path.exists(os.path.join(source_root(), ".git")):
        assert len(harness_version()["harness_commit"]) == 40  # this checkout's commit, read without a process
    else:  # an unpacked sdist, a wheel: no commit to name, and the report says so
        assert harness_version() == {}


def test_the_engines_section_shows_the_settings_the_json_holds(crowded):
    import copy

    s = copy.deepcopy(crowded)
    s["invocation"] = {"command": "harness compare examples/x.yaml --out reports", "spec": "examples/x.yaml"}
    s["versions"] = {"harness_commit": "a" * 40}
    ds, fsdp = s["runs"][1], s["runs"][2]
    ds["describe"] = {
        "ds_config": {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 50000000}},
        "pipeline": {"engine": "deepspeed.pipe.PipelineEngine.train_batch (TrainSchedule, 1F1B)"},
        "coord": {"dp": 0},  # a rank's, not the run's: left out
        "optimizer": "torch.optim.AdamW (foreach)",
    }
    ds["command"] = ["python", "-m", "torch.distributed.run", "-m", "harness.cli", "train", "--point-key", "own dp2"]
    fsdp["describe"] = {"tensor_parallel": {"output": "ColwiseParallel, logits all-gathered (no loss_parallel)"}}
    fsdp["metrics"]["attention_backend"] = "sdpa: flash (torch's choice at [1, 4, 64, 16] torch.float32)"
    md = markdown("t", sections(s, figs=[]), "img")
    eng = md[md.index("## Engines") :]
    assert "Started as `harness compare examples/x.yaml --out reports` (spec: `examples/x.yaml`)" in eng
    assert f"harness commit {'a' * 12}" in eng and "torch 2.13.0" in eng
    assert "ds_config.zero_optimization.overlap_comm: True" in eng
    assert "ds_config.zero_optimization.reduce_bucket_size: 50000000" in eng
    assert "pipeline.engine: deepspeed.pipe.PipelineEngine.train_batch (TrainSchedule, 1F1B)" in eng
    assert "tensor_parallel.output: ColwiseParallel, logits all-gathered (no loss_parallel)" in eng
    assert "attention_backend: sdpa: flash" in eng
    assert "coord" not in eng and "optimizer: torch.optim.AdamW (foreach)" in eng
    assert "python -m torch.distributed.run -m harness.cli train --point-key 'own dp2'" in eng  # as a shell runs it


def test_trace_links_point_only_at_copies_beside_the_report(crowded, tmp_path):
    import copy

    from harness.report.compare import write_report

    s = copy.deepcopy(crowded)
    kept = tmp_path / "logs" / "abc.rank0.trace.json.gz"
    kept.parent.mkdir()
    kept.write_bytes(b"trace")
    s["runs"][1]["traces"] = [{"rank": 0, "role": "rank 0", "path": str(kept)}]
    s["runs"][2]["traces"] = [{"rank": 0, "role": "rank 0", "path": str(tmp_path / "logs" / "gone.json.gz")}]
    out = tmp_path / "reports"
    paths = write_report(s, str(out))
    md = open(paths["markdown"]).read()
    assert (out / "compare-t-traces" / "abc.rank0.trace.json.gz").read_bytes() == b"trace"
    assert "- **own dp2**: [rank 0](compare-t-traces/abc.rank0.trace.json.gz)" in md
    assert "- **own tp2**: 1 trace file(s) not kept beside this report (not linked)" in md
    assert "logs/" not in md.split("## Traces")[1].split("\n## ")[0]
    # the JSON beside it says where the copy is; written again elsewhere without the logs, the link goes
    again = json.loads(open(paths["json"]).read())
    assert again["runs"][1]["traces"][0]["file"] == "compare-t-traces/abc.rank0.trace.json.gz"
    kept.unlink()
    md2 = open(write_report(again, str(tmp_path / "elsewhere"))["markdown"]).read()
    assert "- **own dp2**: 1 trace file(s) not kept beside this report (not linked)" in md2
    again = json.loads(open(paths["json"]).read())
    md3 = open(write_report(again, str(out))["markdown"]).read()  # re-rendered in place: the copy is there
    assert "- **own dp2**: [rank 0](compare-t-traces/abc.rank0.trace.json.gz)" in md3


def test_the_record_names_the_sdpa_backend_torch_chose():
    import torch

    from harness.model.kernels import attention_backend_name
    from harness.model.presets import resolve_shape

    shape = resolve_shape("tiny", None)
    name = attention_backend_name("sdpa", torch.device("cpu"), shape, 64, torch.float32)
    assert name.startswith("sdpa: ") and name.split()[1] in ("flash", "math", "efficient", "cudnn"), name
    assert f"[1, {shape.heads}, 64, {shape.head_dim}]" in name
    assert attention_backend_name("naive", torch.device("cpu"), shape, 64, torch.float32) == "naive"


# ------------------------------------------------------------------ item 9: one source for every figure


def test_the_cpu_demo_readme_counts_the_runs_its_records_hold():
    import collections
    import os
    import re

    here = os.path.join(os.path.dirname(__file__), "..", "reports", "cpu-demo")
    with open(os.path.join(here, "records.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    engines = collections.Counter(r["spec"]["layout"]["engine"] for r in records)
    with open(os.path.join(here, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert f"{len(records)} runs, {engines['own']} layouts of the own engine" in readme
    assert f": {len(records) - engines['own']} runs)" in readme  # DeepSpeed and FSDP2
    assert re.search(rf"the {len(records)} records", readme)


def _record(label: str, tp: int, pp: int, median_ms: float, ci_ms: tuple, **extra) -> dict:
    """A finished 2-process CPU run of the own engine at tp x pp, its step time's median and that median's interval."""
    layout = {"engine": "own", "tp": tp, "pp": pp, "dp": 2 // (tp * pp), "micro_batch_size": 1, **extra}
    median = median_ms / 1e3
    return {
        "run_id": label,
        "status": "ok",
        "sweep": "s",
        "spec": {"layout": layout, "workload": {"model": "tiny", "seq_len": 64, "global_batch_size": 8}},
        "fingerprint": {"device_name": "cpu X", "world_size": 2, "hosts": ["h"]},
        "metrics": {
            "step_time_s": {"median": median, "ci95_low": ci_ms[0] / 1e3, "ci95_high": ci_ms[1] / 1e3, "n": 8},
            "tokens_per_s": 512 / median,
            "tokens_per_s_per_device": 256 / median,
            "flops_per_token": {"palm": 1e6},
        },
    }


def test_a_rows_breakdown_and_its_runs_are_one_breakdown():
    from harness.compare.orchestrate import _breakdown_fields
    from harness.profiling import MEASURED_SOURCE
    from harness.store.fields import MEASURED, row

    assert MEASURED == MEASURED_SOURCE
    measured = {"step": 35.5, "compute": 20.0, "exposed_comm": {"pp": 1.5}, "bubble": 14.0}
    profiled = {"step": 64.1, "compute": 40.0, "exposed_comm": {"pp": 4.0}, "bubble": 20.1}
    rec = _record("r", 1, 2, 35.5, (30.0, 40.0))
    rec["metrics"].update(breakdown_measured_ms=measured, breakdown_ms=profiled, breakdown_source="profiler")
    values, run = row(rec), _breakdown_fields(rec["metrics"])
    assert run["breakdown_ms"] == measured and run["breakdown_source"] == MEASURED_SOURCE
    assert values["breakdown_step_ms"] == 35.5 == run["breakdown_ms"]["step"]  # was the profiled 64.1
    assert values["breakdown_exposed_pp_ms"] == 1.5 and values["breakdown_bubble_ms"] == 14.0
    assert values["breakdown_source"] == MEASURED_SOURCE
    del rec["metrics"]["breakdown_measured_ms"]  # a run without clocked steps: the profiled one, named so
    assert row(rec)["breakdown_step_ms"] == 64.1 and row(rec)["breakdown_source"] == "profiler"


def test_the_compare_json_holds_one_mfu_vs_measured_matmul():
    from harness.compare.orchestrate import with_comparison_peak

    entry = {
        "status": "ok",
        "nproc": 2,
        "row": {},
        "metrics": {
            "flops_per_token": {"palm": 1e6, "megatron": 2e6},
            "tokens_per_s": 1e4,
            "measured_matmul_tflops": 0.02,  # the run's own microbenchmark
            "mfu_vs_measured_matmul": {"palm": 0.25, "megatron": 0.5},  # against it: not the report's figure
        },
    }
    with_comparison_peak(entry, {"tflops": 0.1})
    assert entry["row"]["mfu_vs_measured_matmul"] == pytest.approx(0.05)
    assert entry["metrics"]["mfu_vs_measured_matmul"] == pytest.approx({"palm": 0.05, "megatron": 0.1})
    assert entry["metrics"]["measured_matmul_tflops"] == 0.02


def test_the_sweep_report_divides_every_run_by_one_peak_per_device():
    from harness.report.build import sections_for
    from harness.report.render import markdown

    fast, slow = _record("fast", 1, 1, 10.0, (9.0, 11.0)), _record("slow", 1, 1, 20.0, (19.0, 21.0), attention="naive")
    fast["metrics"]["measured_matmul_tflops"], slow["metrics"]["measured_matmul_tflops"] = 0.1, 0.05  # load moved it
    md = markdown("s", sections_for([fast, slow]), "img")
    # 25,600 and 12,800 tokens/s per device x 1e6 FLOPs / 0.1 TFLOP/s: 25.6% and 12.8%, not 25.6% both
    assert "25.6%" in md and "12.8%" in md
    assert "one peak per device, the highest matmul rate any run of this report measured on it (0.100 TFLOP/s" in md


def test_pipeline_against_tensor_counts_only_decided_pairs_and_names_what_differs():
    from harness.report.data import choose_metric, to_row
    from harness.report.recommend import _tp_vs_pp

    records = [
        _record("pp2", 1, 2, 100.0, (95.0, 105.0), pipeline_schedule="gpipe"),
        _record("tp2", 2, 1, 150.0, (140.0, 160.0), sequence_parallel=True),  # decided: pipeline
        _record("pp2 mb2", 1, 2, 100.0, (90.0, 120.0), micro_batch_size=2),
        _record("tp2 mb2", 2, 1, 101.5, (95.0, 110.0), micro_batch_size=2),  # 1.5% apart, CIs overlap
    ]
    rows = [to_row(r) for r in records]
    text, evidence = _tp_vs_pp(rows, choose_metric(rows))
    assert "of 2 comparison(s)" in text
    assert (
        "the pipeline-heavier was decidedly faster in 1, the tensor-heavier in 0, and 1 were not distinguishable"
        in text
    )
    assert "any pipeline schedule" in text and "with or without sequence parallelism" in text
    assert "GPUs" not in text
    assert [r[-1] for r in evidence.rows] == ["decided: pipeline"] * 2 + ["not distinguishable"] * 2


def test_a_sweeps_oversubscribed_run_is_neither_ranked_nor_explained():
    from harness.report.build import sections_for
    from harness.report.data import choose_metric, to_row
    from harness.report.ranking import ranked
    from harness.report.render import markdown

    fine, crowded = _record("fine", 1, 1, 20.0, (19.0, 21.0)), _record("crowded", 1, 1, 10.0, (9.0, 11.0))
    for rec, threads in ((fine, "1"), (crowded, "2")):  # 2 processes x 2 threads on 2 cores: 4 busy threads
        rec["fingerprint"].update(device_type="cpu", cpu_cores=2, env={"OMP_NUM_THREADS": threads})
    rows = [to_row(r) for r in (fine, crowded)]
    assert [r.oversubscribed for r in rows] == [False, True]
    assert [r.run_id for r in ranked(rows, choose_metric(rows))] == ["fine"]
    md = markdown("s", sections_for([fine, crowded]), "img")
    assert "1 run(s) ran more busy threads (processes x threads) than their machine's usable cores" in md


def test_the_compare_command_says_before_launch_which_runs_will_be_oversubscribed(capsys, monkeypatch):
    import os

    from harness.commands.compare import _say_oversubscribed
    from harness.compare.spec import load_compare_spec

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("harness.launch.cpu_cores", lambda: 2)
    monkeypatch.setattr("harness.launch.environment.cpu_cores", lambda: 2)
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-moe.yaml")
    _say_oversubscribed(load_compare_spec(example))
    assert (
        "runs of 4 processes x 1 thread(s) each exceed this machine's 2 cores: oversubscribed"
        in capsys.readouterr().err
    )


# ------------------------------------------------------------------ item 1: every interval says its real coverage


def test_every_interval_of_the_median_says_its_real_coverage(crowded):
    """8 measured steps: the median's interval is the range, covering 1 - 2/256 = 99.2%, not 95%. The table
    of runs, the matrix and the figures say so; a run recorded before ci_coverage gets it from its n."""
    import copy

    from harness.measure.stats import summarize
    from harness.report.compare import figures

    s = copy.deepcopy(crowded)
    for i, r in enumerate(s["runs"]):
        times = [(10.0 + i + 0.1 * k) / 1e3 for k in (3, 0, 7, 1, 5, 2, 6, 4)]
        st = summarize(times)
        r["metrics"].update(step_times_s=times, step_time_s=st)
        r["row"].update(
            step_time_median_s=st["median"],
            step_time_ci95_s=[st["ci95_low"], st["ci95_high"]],
            steps_measured=8,
            step_time_ci_coverage=st["ci_coverage"],
        )
    old = s["runs"][1]  # written before coverage was kept
    del old["metrics"]["step_time_s"]["ci_coverage"], old["row"]["step_time_ci_coverage"]
    md = markdown("t", sections(s, figs=[]), "img")
    assert "95% CI" not in md and "median interval (coverage)" in md
    runs = md[md.index("| Run |") :]
    assert "| [11.0 ms, 11.7 ms] (99.2%) |" in runs[: runs.index("\n\n")]  # the old record: from n = 8
    matrix = md[md.index("## Layouts by engine") :]
    assert "11.4 ms [11.0, 11.7] (99.2%) pass" in matrix[: matrix.index("\n## ")]
    alts = {name: alt for name, _, alt in figures(s)}
    assert alts["throughput"].endswith("interval of the median (99.2%)") and "95%" not in alts["throughput"]
