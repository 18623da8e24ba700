"""The planner: profiles, memory and time structure, CLI contract, errors, calibration."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from harness.errors import SpecError
from harness.measure.mfu import datasheet_peak_tflops
from harness.model.presets import PRESETS
from harness.planner import calibrate_from_records, predict
from harness.planner.hardware import load_profile, profile_names
from harness.planner.layout import PlannerLayout, Workload, stage_items
from harness.planner.memory import worst_stage_memory
from harness.store import ResultsStore

WL = Workload(2048, 2048)
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
S13 = PRESETS["paper-13b"]


def run_cli(*argv):
    return subprocess.run([sys.executable, "-m", "harness.cli", "plan", *argv], capture_output=True, text=True)


def test_profiles_load_and_peaks():
    assert set(profile_names()) >= {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "cpu"}
    for name in profile_names():
        prof = load_profile(name)
        assert prof.peak_tflops_bf16 > 0 and prof.memory_gib > 0
    peaks = {
        "NVIDIA A100-SXM4-80GB": 312,
        "NVIDIA H100 80GB HBM3": 989,
        "NVIDIA H100 PCIe": 756,
        "NVIDIA H100 NVL": 835,
        "NVIDIA H200": 989,
        "NVIDIA GH200 480GB": 989,
        "NVIDIA B200": 2250,
        "NVIDIA GB200": 2500,
        "NVIDIA L40S": 362,
        "Some CPU": None,
    }
    assert {name: datasheet_peak_tflops(name) for name in peaks} == peaks  # the one table MFU reads
    with pytest.raises(SpecError) as e:
        load_profile("tpu-v9")
    assert e.value.field == "--hardware"


def test_stage_split_is_uniform_over_embedding_layers_norm_head():
    assert stage_items(S13, 2) == [(True, 21, False), (False, 19, True)]  # 43 items: 22 + 21
    assert sum(x[1] for x in stage_items(PRESETS["paper-30b"], 4)) == 60


def mem(**kw):
    base = dict(tp=1, pp=1, dp=64, micro_batch_size=1, attention="flash2", rmsnorm="fused")
    return worst_stage_memory(S13, PlannerLayout(**{**base, **kw}), WL)[1]


def test_memory_structure():
    assert mem(zero_stage=0)["optimizer"] == pytest.approx(64 * mem(zero_stage=1)["optimizer"])
    assert mem(attention="naive")["activations"] > 1.5 * mem()["activations"]  # the s^2 term
    assert mem(activation_checkpointing="full")["activations"] < 0.1 * mem()["activations"]
    assert mem(tp=2, dp=32, sequence_parallel=True)["activations"] < mem(tp=2, dp=32)["activations"]
    assert mem(rmsnorm="torch")["activations"] > mem()["activations"]
    assert mem(micro_batch_size=2)["total"] > mem()["total"]


def test_study_facts_on_memory():
    """Published outcomes (13B, 64 A100-80GB): the fused RMSNorm is what lets tp=pp=1 fit."""
    prof = load_profile("a100-80gb")
    lay = PlannerLayout(1, 2, 32, 1, attention="flash2", rmsnorm="fused")
    assert predict(S13, lay, WL, prof).fits
    assert not predict(S13, PlannerLayout(1, 1, 64, 2, attention="flash2", rmsnorm="fused"), WL, prof).fits
    assert not predict(S13, PlannerLayout(1, 1, 64, 1, attention="flash2", rmsnorm="torch"), WL, prof).fits
    # Full checkpointing, 4 x 2048 tokens: the naive kernel's s x s backward transients on top of
    # the loss peak make it run out of memory where flash attention and the fused softmax fit.
    full = dict(tp=1, pp=1, dp=64, micro_batch_size=4, activation_checkpointing="full", rmsnorm="torch")
    assert predict(S13, PlannerLayout(**full, attention="flash2"), WL, prof).fits
    assert predict(S13, PlannerLayout(**full, attention="fused_softmax"), WL, prof).fits
    assert not predict(S13, PlannerLayout(**full, attention="naive"), WL, prof).fits


def test_time_structure():
    prof = load_profile("a100-80gb")

    def p(**kw):
        return predict(S13, PlannerLayout(**{**dict(tp=1, pp=1, dp=64, micro_batch_size=1), **kw}), WL, prof)

    assert p(attention="naive").step_time_s > p(attention="flash1").step_time_s > p().step_time_s
    assert p(rmsnorm="torch").step_time_s > p().step_time_s
    assert p(activation_checkpointing="full").step_time_s > 1.2 * p().step_time_s
    assert p(pp=2, dp=32).time_breakdown_s["bubble_s"] > 0
    assert 0.3 < p().mfu < 0.9
    # compiled blocks: the norm fused (time and memory as the fused kernel's) and fewer launches, so faster
    # than the fused norm alone; nothing outside the blocks changes
    eager, fused, compiled = p(rmsnorm="torch"), p(), p(rmsnorm="torch", compile="blocks")
    assert compiled.memory_gib == fused.memory_gib < eager.memory_gib
    assert compiled.step_time_s < fused.step_time_s < eager.step_time_s
    for term in ("dp_reduction_exposed_s", "optimizer_s"):
        assert compiled.time_breakdown_s[term] == eager.time_breakdown_s[term]


def test_dp_reduction_aggregates_rails_only_unpipelined_within_the_node_limit(tmp_path):
    """A group spanning more nodes than rail_aggregation_max_nodes reduces as over one NIC per
    member (the published 30B runs on 32 nodes), as pipelined runs always do."""
    prof = load_profile("a100-80gb")
    s30 = PRESETS["paper-30b"]

    def dp_s(prof, lay):
        return predict(s30, lay, WL, prof).time_breakdown_s["dp_reduction_exposed_s"]

    lay8, lay32 = PlannerLayout(4, 1, 16, 1), PlannerLayout(4, 1, 64, 1)  # 8 and 32 nodes, 2 members per node
    assert dp_s(prof, lay32) == pytest.approx(2 * dp_s(prof, lay8) * (63 / 64) / (15 / 16), rel=1e-6)
    raw = yaml.safe_load((REPO / "harness/planner/hardware/a100-80gb.yaml").read_text())
    (tmp_path / "big.yaml").write_text(yaml.safe_dump({**raw, "rail_aggregation_max_nodes": 64}))
    assert dp_s(load_profile(str(tmp_path / "big.yaml")), lay32) == pytest.approx(dp_s(prof, lay32) / 2, rel=1e-6)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**raw, "rail_aggregation_max_nodes": 0}))
    with pytest.raises(SpecError, match="rail_aggregation_max_nodes"):
        load_profile(str(tmp_path / "bad.yaml"))


def test_impossible_layouts_are_spec_errors():
    prof = load_profile("a100-80gb")
    with pytest.raises(SpecError, match="pipeline stages"):
        predict(PRESETS["tiny"], PlannerLayout(1, 4, 1, 1), Workload(128, 8), prof)
    with pytest.raises(SpecError):
        predict(S13, PlannerLayout(3, 1, 1, 1), WL, prof)


def test_layout_converts_to_and_from_a_spec_layout():
    """One conversion each way, the fields named as harness.spec names them."""
    from harness.spec import parse_spec

    lay = PlannerLayout(
        2,
        2,
        2,
        2,
        activation_checkpointing="selective",
        sequence_parallel=True,
        attention="sdpa",
        rmsnorm="torch",
        zero_stage=1,
        pipeline_schedule="interleaved",
        virtual_stages=2,
    )
    raw = lay.to_spec()
    assert raw["engine"] == "own" and PlannerLayout.from_spec(raw) == lay
    spec = parse_spec({"workload": {"model": "tiny-4l", "global_batch_size": 16}, "layout": raw})
    assert PlannerLayout.from_spec(spec.to_dict()["layout"]) == lay
    fsdp = PlannerLayout(1, 1, 8, 1, zero_stage=0, fsdp=True)
    assert fsdp.to_spec()["engine"] == "fsdp" and PlannerLayout.from_spec(fsdp.to_spec()) == fsdp
    # engine single is one GPU; a missing or null field takes the spec's default
    assert PlannerLayout.from_spec({"engine": "single", "tp": 4, "virtual_stages": None}) == PlannerLayout(
        1, 1, 1, 1, attention="sdpa", rmsnorm="torch", zero_stage=0
    )


def test_planner_kernels_are_the_harness_ones_the_study_extras_and_the_gpu_kernels():
    from harness.planner.layout import ATTENTION, ATTENTION_CLASS, EXTRA_ATTENTION
    from harness.spec import ATTENTION_KERNELS

    assert EXTRA_ATTENTION == ("fused_softmax", "flash1", "flash3", "te_fused")
    assert set(ATTENTION) == set(ATTENTION_KERNELS) | set(EXTRA_ATTENTION) == set(ATTENTION_CLASS)


@pytest.mark.slow  # runs the CLI in a process
def test_cli_json_contract():
    r = run_cli(
        *(
            "--model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 64 --gpus-per-node 8 --hardware "
            "a100-80gb --attention flash2 --rmsnorm fused --format json --top 5"
        ).split()
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 5
    assert set(rows[0]) == {
        *(
            "tp cp cp_impl pp dp micro_batch_size activation_checkpointing sequence_parallel attention rmsnorm zero "
            "precision compile pipeline_schedule virtual_stages dp_shard ep fits within_allocator_margin memory_gib "
            "step_time_s mfu"
        ).split()
    }
    assert all(r_["fits"] for r_ in rows) and rows[0]["mfu"] >= rows[-1]["mfu"]


@pytest.mark.slow  # runs the CLI in a process
def test_cli_errors_exit_2():
    base = ["--model", "paper-13b", "--seq-len", "2048", "--global-batch-size", "2048"]
    r = run_cli(*base, "--gpus", "12", "--gpus-per-node", "8")
    assert r.returncode == 2 and "error: --gpus:" in r.stderr
    r = run_cli(*base, "--gpus", "8", "--hardware", "tpu")
    assert r.returncode == 2 and "error: --hardware:" in r.stderr
    r = run_cli(*base, "--gpus", "8", "--attention", "flash9")
    assert r.returncode == 2 and "error: --attention:" in r.stderr
    r = run_cli("--gpus", "8")
    assert r.returncode == 2 and "error: --model:" in r.stderr


@pytest.mark.slow  # runs the CLI in a process
def test_emit_sweep_and_explain(tmp_path):
    out = tmp_path / "sweep.yaml"
    r = run_cli(
        *(
            "--model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 32 --attention flash2 --rmsnorm "
            "fused,torch --top 3 --explain --emit-sweep"
        ).split(),
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "memory GiB" in r.stdout
    import yaml

    spec = yaml.safe_load(out.read_text())
    assert len(spec["points"]) == 3 and spec["workload"]["model"] == "paper-13b"


@pytest.mark.slow  # runs the CLI in a process
def test_table_marks_layouts_within_the_calibration_error():
    args = (
        *(
            "--model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 64 --attention flash2 --rmsnorm fused "
            "--top 40"
        ).split(),
    )
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.strip()[:1].isdigit()]
    marked = [line for line in rows if line.endswith(" *")]
    # The fastest is always marked; with a band of the calibration's error not all 40 are.
    err = load_profile("a100-80gb").calibrated["median_abs_error_pct"]
    assert rows[0].endswith(" *") and 1 <= len(marked) < len(rows)
    assert rows[: len(marked)] == marked  # the band is a prefix of the ranking
    assert f"{len(marked)} layouts within {err:.1f}%" in r.stdout
    r = run_cli(*args[:-2], "--top", "3", "--hardware", "a100-40gb")
    assert r.returncode == 0 and "not calibrated" in r.stdout and " *" not in r.stdout


@pytest.mark.slow  # runs the CLI in a process
def test_65b_over_4096_gpus_through_the_cli():
    """The speed target (under 1 s) is a benchmark, benchmarks/plan_speed.py, not a timed test."""
    r = run_cli(*"--model paper-65b --seq-len 2048 --global-batch-size 2048 --gpus 4096 --format json --top 3".split())
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 3 and all(row["tp"] * row["pp"] * row["dp"] == 4096 and row["fits"] for row in rows)


# ---------------------------------------------------------------- calibration from records


def _record(run_id, model, tp, pp, dp, mb, seq, gbs, step):
    return {
        "schema_version": 1,
        "run_id": run_id,
        "status": "ok",
        "spec": {
            "workload": {
                "model": model,
                "model_overrides": {},
                "seq_len": seq,
                "global_batch_size": gbs,
                "steps": 10,
                "warmup_steps": 2,
                "precision": "fp32",
            },
            "layout": {
                "engine": "own" if tp * pp * dp > 1 else "single",
                "tp": tp,
                "pp": pp,
                "dp": dp,
                "micro_batch_size": mb,
                "activation_checkpointing": "none",
                "sequence_parallel": False,
                "attention": "naive",
                "rmsnorm": "torch",
                "zero_stage": 0,
                "pipeline_schedule": "1f1b",
            },
        },
        "metrics": {"step_time_s": {"median": step, "mean": step, "n": 8}},
        "fingerprint": {},
    }


def test_calibrate_on_synthetic_cpu_store_predicts_held_back_run(tmp_path):
    """Ground truth: a CPU whose efficiencies differ from the shipped profile by 2-4x."""
    from harness.planner.calibrate import read_store
    from harness.planner.timing import theta_from_profile

    base = load_profile("cpu")
    truth = dict(theta_from_profile(base))
    truth.update(
        gemm=truth["gemm"] * 3.0,
        hbm=truth["hbm"] * 2.0,
        launch_us=truth["launch_us"] * 0.5,
        naive_attention=truth["naive_attention"] * 4.0,
        nvlink=truth["nvlink"] * 2.5,
    )
    grid = [
        ("tiny", 1, 1, 1, 1, 128, 8),
        ("tiny", 1, 1, 1, 2, 256, 8),
        ("tiny-4l", 1, 1, 1, 1, 128, 8),
        ("tiny-4l", 2, 1, 1, 2, 128, 8),
        ("tiny-4l", 1, 2, 1, 1, 128, 8),
        ("tiny", 1, 1, 2, 1, 128, 8),
        ("tiny-256", 1, 1, 1, 1, 128, 4),
        ("tiny-256", 2, 1, 1, 1, 256, 4),
        ("tiny-4l", 1, 1, 1, 4, 512, 8),
    ]
    held_back = ("tiny-256", 2, 2, 1, 1, 256, 8)
    recs = []
    for i, (model, tp, pp, dp, mb, seq, gbs) in enumerate(grid + [held_back]):
        lay = PlannerLayout(tp, pp, dp, mb, attention="naive", rmsnorm="torch", zero_stage=0)
        t = predict(PRESETS[model], lay, Workload(seq, gbs, 4), base, theta=truth).step_time_s
        recs.append(_record(f"r{i}", model, tp, pp, dp, mb, seq, gbs, t))
    db = tmp_path / "results.sqlite"
    store = ResultsStore(str(db))
    for r in recs:
        store.write(r)
    records = read_store(str(db))
    with pytest.raises(SpecError) as e:
        read_store(str(tmp_path / "missing.sqlite"))
    assert e.value.field == "--calibrate"
    train = [r for r in records if r["run_id"] != f"r{len(grid)}"]
    prof, report = calibrate_from_records(train, base)
    assert report["samples"] == len(grid) and report["median_abs_error_pct"] < 5
    model, tp, pp, dp, mb, seq, gbs = held_back
    held_lay = PlannerLayout(tp, pp, dp, mb, attention="naive", rmsnorm="torch", zero_stage=0)
    got = predict(PRESETS[model], held_lay, Workload(seq, gbs, 4), prof).step_time_s
    want = recs[-1]["metrics"]["step_time_s"]["median"]
    assert abs(got - want) / want < 0.15
    # the uncalibrated profile is far off, so the test means something
    raw = predict(PRESETS[model], held_lay, Workload(seq, gbs, 4), base).step_time_s
    assert abs(raw - want) / want > 0.3


@pytest.mark.slow  # runs the CLI in a process
def test_cli_calibrate_writes_profile(tmp_path):
    out = tmp_path / "cal.yaml"
    r = run_cli(
        "--hardware",
        "a100-80gb",
        "--calibrate-csv",
        str(REPO / "baselines/paper_sweeps/llama_13B_bfloat16_32_GPUs_sequence_parallelism.csv"),
        "--calibrate-out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "median" in r.stdout and out.is_file()
    prof = load_profile(str(out))
    assert prof.calibrated["samples"] == 16


def test_hopper_attention_is_its_own_class_and_absent_before_hopper():
    """FlashAttention-3 and cuDNN's fused attention (TE, SDPA's cudnn backend) run at their own
    rate on Hopper; A100 offers neither FA3 nor TE's fused kernel; Blackwell has no FA3."""
    from harness.model.presets import PRESETS
    from harness.planner.hardware import load_profile
    from harness.planner.layout import ATTENTION_CLASS, PlannerLayout, Workload
    from harness.planner.predict import predict

    assert ATTENTION_CLASS["sdpa_cudnn"] == ATTENTION_CLASS["te_fused"] == ATTENTION_CLASS["flash3"] == "flash3"
    assert ATTENTION_CLASS["sdpa_flash"] == "flash2"
    assert "flash3" not in load_profile("a100-80gb").attention_kernels
    assert "flash3" not in load_profile("b200").attention_kernels
    assert "te_fused" in load_profile("b200").attention_kernels
    prof, shape, wl = load_profile("h100-sxm"), PRESETS["llama3-8b"], Workload(8192, 64)
    t = {a: predict(shape, PlannerLayout(1, 1, 8, 1, attention=a), wl, prof).step_time_s for a in ("flash2", "flash3")}
    assert prof.eff("flash3") > prof.eff("flash2") and t["flash3"] < t["flash2"]
