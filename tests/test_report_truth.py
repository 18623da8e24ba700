"""Issue 41, items 2, 8 and 9: a comparison report states cores, processes and threads per run and keeps
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


def test_a_baseline_check_leaves_oversubscribed_step_times_out(crowded):
    assert compare_with_baseline(crowded, _slower(crowded), 0.1)["drifts"]  # 3x slower: a drift
    assert compare_with_baseline(crowded, _one_core(_slower(crowded)), 0.1)["drifts"] == []  # oversubscribed now


def _slower(summary: dict) -> dict:
    import copy

    s = copy.deepcopy(summary)
    for r in s["runs"]:
        if r["label"] == "own tp2":
            st = r["metrics"]["step_time_s"]
            r["metrics"]["step_time_s"] = {k: (3 * v if k != "n" else v) for k, v in st.items()}
    return s


# ------------------------------------------------------------------ item 8: reproduce a run from its report


def test_the_json_holds_each_runs_command_spec_and_the_versions(crowded):
    from harness.store.record import harness_version

    run = crowded["runs"][1]
    assert run["spec"]["layout"]["dp"] == 2 and run["spec"]["workload"]["seq_len"] == crowded["workload"]["seq_len"]
    assert "command" in run  # the launcher's command as the record keeps it (None from this stand-in launcher)
    assert crowded["versions"] == harness_version()
    assert len(harness_version()["harness_commit"]) == 40  # this checkout's commit, read without a process


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
    }
    ds["command"] = ["python", "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "harness.cli", "train"]
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
    assert "coord" not in eng
    assert "python -m torch.distributed.run --nproc_per_node=2 -m harness.cli train" in eng


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
