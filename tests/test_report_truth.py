"""Issue 41, items 2, 8 and 9: a comparison report states cores, processes and threads per run and keeps
oversubscribed runs out of ranking and Why; a reader can reproduce a run from the report (command,
versions, spec, resolved engine settings, trace links that exist); the JSON and the sweep report say
what the Markdown says. Summaries built by a stand-in launcher (tests/test_report_plots.fake_launcher):
no process starts."""

from __future__ import annotations

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
