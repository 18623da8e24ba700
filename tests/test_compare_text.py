"""The comparison report's own words and columns: how many processes each run had, a column no
run can fill left out, the loss table one row per run, MFU against one matmul peak per
comparison, and a like-for-like pair of the two Megatron-style engines in the default spec."""

import copy

import pytest

from harness.compare.orchestrate import run_comparison, with_comparison_peak
from harness.compare.spec import DEFAULT, parse_compare_spec
from harness.report.compare import loss_rows, results_table, sections
from harness.report.render import html_page, markdown
from harness.spec import process_counts
from harness.testing.workloads import tiny_workload

LOSSES = [5.5, 5.4, 5.3]


def _launch(tokens_per_s: dict):
    def launch(spec, *, nproc, launcher, store_path, timeout_s, sweep, point_key, log_dir):
        return {
            "run_id": point_key,
            "status": "ok",
            "spec": spec,
            "fingerprint": {},
            "launch": {"launcher": launcher},
            "metrics": {
                "losses": LOSSES,
                "tokens_per_s": tokens_per_s[point_key],
                "flops_per_token": {"palm": 1e6},
                "step_time_s": {"median": 0.01, "ci95_low": 0.009, "ci95_high": 0.012, "n": 2},
                "mfu_vs_measured_matmul": {"palm": 0.5},  # each run's own peak: must not be what the report shows
                "engine": {"optimizer": "AdamW"},
            },
        }

    return launch


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    raw = {"name": "t", "nproc": 2, "parity_steps": 3, "workload": tiny_workload(), "runs": [{"engine": "fsdp"}]}
    cs = parse_compare_spec(raw)
    speeds = {"reference (single device)": 2000.0, "FSDP2 reshard": 3000.0}
    store = str(tmp_path_factory.mktemp("c") / "r.sqlite")
    s = run_comparison(cs, store_path=store, progress=False, launch_fn=_launch(speeds))
    s["matmul_peak"] = {"tflops": 0.01, "dtype": "float32", "device": "cpu", "threads": 1}
    for r in s["runs"]:
        with_comparison_peak(r, s["matmul_peak"])
    return s


def test_process_counts_name_each_count():
    assert process_counts([1, 2, 2]) == "3 runs: 2 on 2 processes, 1 on 1 process"
    assert process_counts([4]) == "1 run: 1 on 4 processes"


def test_the_report_says_the_reference_ran_one_process(summary):
    md = markdown("t", sections(summary, figs=[]), "img")
    assert "2 runs: 1 on 1 process, 1 on 2 processes" in md
    assert "processes per run" not in md


def test_columns_no_run_can_fill_are_left_out(summary):
    t = results_table(summary)
    assert "MFU" not in t.headers and "HFU" not in t.headers and "MFU megatron" not in t.headers  # no CPU datasheet
    assert "MFU vs measured matmul" in t.headers


def test_mfu_vs_measured_matmul_divides_every_run_by_the_comparisons_one_peak(summary):
    t = results_table(summary)
    col = t.headers.index("MFU vs measured matmul")
    cells = {row[0]: row[col] for row in t.rows}
    # 1e6 FLOPs/token x tokens/s / (processes x 0.01e12): 2000/1 -> 20.0%, 3000/2 -> 15.0%
    assert cells == {"reference (single device)": "20.0%", "FSDP2 reshard": "15.0%"}
    md = markdown("t", sections(summary, figs=[]), "img")
    assert "one peak for the whole comparison: 0.010 TFLOP/s" in md


def test_no_peak_leaves_the_column_empty_rather_than_a_runs_own():
    entry = {"status": "ok", "nproc": 2, "metrics": {"flops_per_token": {"palm": 1.0}, "tokens_per_s": 1.0}, "row": {}}
    assert with_comparison_peak(entry, None)["row"]["mfu_vs_measured_matmul"] is None


def test_the_loss_table_has_a_row_per_run_and_a_column_per_step(summary):
    headers, rows = loss_rows(summary)
    assert headers == ["Run", "step 0", "step 1", "step 2"]
    assert [r[0] for r in rows] == ["reference (single device)", "FSDP2 reshard"] and len(rows[0]) == 4


def test_html_tables_scroll_inside_the_page(summary):
    assert "<div class='wide'><table>" in html_page("t", sections(summary, figs=[]))


def test_the_default_comparison_runs_own_and_megatron_at_one_layout_and_kernel():
    cs = parse_compare_spec(copy.deepcopy(DEFAULT))

    def key(run):
        lay = run.spec.layout
        return (lay.tp, lay.pp, lay.cp, lay.dp, lay.micro_batch_size, lay.attention, lay.activation_checkpointing)

    own = {key(r) for r in cs.runs if r.spec.layout.engine == "own"}
    assert own & {key(r) for r in cs.runs if r.spec.layout.engine == "megatron"}


def test_the_jsons_breakdown_is_the_one_the_report_sets_against_the_median():
    from harness.compare.orchestrate import _breakdown_fields

    measured, profiled = {"compute": 9.0, "step": 10.0}, {"compute": 15.0, "step": 19.0}
    m = {"breakdown_measured_ms": measured, "breakdown_ms": profiled, "breakdown_source": "profiler", "collectives": []}
    got = _breakdown_fields(m)
    assert got["breakdown_ms"] == measured and got["breakdown_source"] == "measured steps"
    assert got["breakdown_profiled_ms"] == profiled  # kept apart, named for what it is
    only_profiled = _breakdown_fields({"breakdown_ms": profiled, "breakdown_source": "profiler"})
    assert only_profiled["breakdown_ms"] == profiled and only_profiled["breakdown_source"] == "profiler"
