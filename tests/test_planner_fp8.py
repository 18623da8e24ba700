"""The planner's FP8 (PlannerLayout.precision fp8, `harness plan --precision`): the linear layers' GEMMs at
the FP8 peak, the casts' HBM bytes, FSDP2's fp8 all-gather, the weight copies, and the refusals."""

import dataclasses
import json

import numpy as np
import pytest

from harness.cli import main as cli
from harness.model.presets import Shape, resolve_shape
from harness.planner import fp8
from harness.planner.calibrate import Sample, fit, sample_from_record
from harness.planner.features import layer_features, stage_extras, theta_from_profile
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.memory_engines import engine_stage_memory
from harness.planner.memory_fsdp import fsdp_step_bytes
from harness.planner.timing import _data_parallel, _stage_kinds, step_features, step_time

# the literature constants: the figures below are worked out with them, not with a fit that moves
H100 = dataclasses.replace(load_profile("h100-sxm"), calibrated={})
L8 = resolve_shape("llama3-8b")
WL = Workload(8192, 128)


def both(**kw) -> tuple[PlannerLayout, PlannerLayout]:
    lay = PlannerLayout(**{"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "engine": "own", **kw})
    return lay, dataclasses.replace(lay, precision="fp8")


def test_fp8_gemms_run_at_the_fp8_peak_and_attention_stays_bf16():
    bf16, f8 = both(activation_checkpointing="selective")
    xb, xf = layer_features(L8, bf16, WL, H100), layer_features(L8, f8, WL, H100)
    assert xf["gemm"] == 0 and xb["gemm_fp8"] == 0
    # the same FLOPs at the same size factor: exactly the peak ratio (1e-12: rounding of one division)
    assert xf["gemm_fp8"] == pytest.approx(xb["gemm"] * 989 / 1979, rel=1e-12)
    assert xf["flash2"] == xb["flash2"]  # attention in bf16
    # the LM head stays bf16 (torchtitan filters `output`; Megatron's is not a TE module)
    assert stage_extras(L8, f8, WL, H100, 0)["gemm"] == stage_extras(L8, bf16, WL, H100, 0)["gemm"] > 0


def test_fp8_step_is_faster_than_bf16_where_the_gemms_dominate():
    bf16, f8 = both(activation_checkpointing="selective")
    t_bf16, t_fp8 = step_time(L8, bf16, WL, H100)[0], step_time(L8, f8, WL, H100)[0]
    assert t_fp8 < t_bf16
    # and never more than the GEMMs' own speed-up: the rest is bf16 work plus the casts
    assert t_bf16 / t_fp8 < (1979 * H100.eff("gemm_fp8")) / (989 * H100.eff("gemm"))


def test_cast_bytes_per_layer_follow_the_stated_formula():
    """A tiny shape by hand: hidden 64, ffn 128, 4 heads of 16, 2 KV heads, tp 2, 10 tokens; torchao's
    seven linears (wq, wk, wv, wo, w1, w3, w2) as (N, K): (32,64) (16,64) (16,64) (64,32) (64,64) (64,64) (64,64)."""
    shape = Shape(2, 64, 128, 4, 2, 256)
    lay = PlannerLayout(2, 1, 1, 1, precision="fp8", engine="own")
    n, B = 10, 2
    sum_nk = 96 + 80 + 80 + 96 + 128 + 128 + 128  # N + K per linear: inputs and output gradients per token
    weights = 2048 + 1024 + 1024 + 2048 + 4096 + 4096 + 4096
    assert fp8.activation_cast_bytes(shape, lay, n, B) == (2 * B + 2) * n * sum_nk  # tensorwise: 6 bytes
    assert fp8.activation_cast_bytes(shape, lay, n, B, "rowwise") == (3 * B + 2) * n * sum_nk
    # rowwise_with_gw_hp: dim0 casts only (torchao's roofline), the weight gradient's operands stay bf16
    assert fp8.activation_cast_bytes(shape, lay, n, B, "rowwise_with_gw_hp") == (B + 1) * n * sum_nk
    assert fp8.weight_cast_bytes(shape, lay, 4, B) == (3 * B + 2) * weights  # every micro-batch, fwd + bwd
    # the planner's layer features carry exactly these bytes on top of bf16's (one micro-batch, no recompute)
    wl = Workload(10, 1)
    xb = layer_features(shape, dataclasses.replace(lay, precision="bf16"), wl, H100)
    xf = layer_features(shape, lay, wl, H100)
    extra = (xf["hbm"] - xb["hbm"]) * H100.hbm_gbps * 1e9
    assert extra == pytest.approx((2 * B + 2) * n * sum_nk + (3 * B + 2) * weights, rel=1e-12)
    # Transformer Engine: q/k/v (N 64) and w1/w3 (N 128) fused, their input cast once; weights once per step
    te = dataclasses.replace(lay, engine="megatron")
    assert fp8.activation_cast_bytes(shape, te, n, B) == (2 * B + 2) * n * (128 + 96 + 192 + 128)
    assert fp8.weight_cast_bytes(shape, te, 4, B) == (2 * B + 2) * weights / 4
    # FSDP2's fp8 all-gather: the shard cast before each of the 2 gathers of a micro-batch, plus the amax once a step
    fs = dataclasses.replace(lay, engine="fsdp", fsdp=True, dp=4)
    assert fp8.weight_cast_bytes(shape, fs, 4, B) == (2 * (B + 1) + B / 4) * weights / 4


def test_fsdp_fp8_all_gather_halves_the_gathered_linear_weights_and_their_traffic():
    bf16, f8 = both(engine="fsdp", fsdp=True)
    lin = fp8.weight_elements(L8, 1)
    b, f = fsdp_step_bytes(L8, bf16, WL, False, 32, False), fsdp_step_bytes(L8, f8, WL, False, 32, False)
    assert b["all_blocks"] - f["all_blocks"] == 32 * lin  # 2 bytes -> 1 per linear weight
    assert b["backward_blocks"] - f["backward_blocks"] == 2 * lin
    assert f["reduce_scatter"] == b["reduce_scatter"]  # the reduce-scatter stays fp32
    kinds = _stage_kinds(L8.layers, 1)
    (key, xb), (_, xf) = (next(iter(_data_parallel(L8, lay, WL, H100, kinds)[0].items())) for lay in (bf16, f8))
    m, frac = WL.micro_batches(bf16), 7 / 8
    assert (xb - xf) * H100.nvlink_gbps * 1e9 == pytest.approx(2 * m * frac * 32 * lin, rel=1e-9)


def test_fp8_memory_terms_by_engine():
    """torchao saves the bf16 input and weight (float8_linear.py): the activations held do not change;
    Transformer Engine keeps an fp8 weight and its transpose (2 bytes per linear parameter) and saves its
    linears' inputs in fp8 (one byte less per element of QKV's, FC1's and FC2's; the projection's fp8 input
    one byte more, beside the attention's bf16 output; 32 layers, one micro-batch held)."""
    for engine in ("own", "megatron"):
        bf16, f8 = both(engine=engine, activation_checkpointing="selective")
        mb, mf = engine_stage_memory(L8, bf16, WL, 0), engine_stage_memory(L8, f8, WL, 0)
        n, h, f = f8.micro_batch_size * WL.seq_len, L8.hidden, L8.ffn
        # tp 1: QKV's and FC1's inputs in h, FC2's in f, saved one byte each in fp8; the projection's fp8
        # input (h) is saved beside the bf16 attention output the kernel keeps (fp8.saved_input_saving)
        saved = 32 * n * (2 * h + f) - 32 * n * h if engine == "megatron" else 0
        assert mb["activations"] - mf["activations"] == pytest.approx(saved, rel=1e-12)
        copies = 2 * 32 * fp8.weight_elements(L8, 1) if engine == "megatron" else 0
        assert mf["fp8_weights_and_scales"] == copies + fp8.scale_bytes(L8, f8, 32)
        assert fp8.scale_bytes(L8, f8, 32) < 1e-6 * mf["total"]  # the scales: negligible, counted
        assert "fp8_weights_and_scales" not in mb


def test_step_time_stays_linear_in_theta_under_fp8():
    """Calibration fits theta by least squares: the step time must be sum(theta x features) under fp8 too."""
    _, f8 = both(engine="fsdp", fsdp=True, activation_checkpointing="full")
    feats, _ = step_features(L8, f8, WL, H100)
    theta = theta_from_profile(H100)
    assert sum(theta[k] * v for k, v in feats.items()) == pytest.approx(step_time(L8, f8, WL, H100)[0], rel=1e-9)


def test_calibration_fits_gemm_fp8():
    """Exact step times made with gemm_fp8 0.5: the fit moves it from its prior (0.63) towards 0.5; the
    only thing holding it back is the ridge pull to the prior, so it ends between them, nearer 0.5."""
    truth = dataclasses.replace(H100, efficiency={**H100.efficiency, "gemm_fp8": 0.5})
    samples = []
    for mb in (1, 2):
        for ck in ("none", "selective", "full"):
            _, lay = both(micro_batch_size=mb, activation_checkpointing=ck)
            samples.append(Sample(L8, lay, WL, step_time(L8, lay, WL, truth)[0]))
    prof, report = fit(samples, H100)
    assert "gemm_fp8" in report["fitted"]
    got = prof.calibrated["efficiency"]["gemm_fp8"]
    assert 0.5 <= got < 0.63 and got - 0.5 < 0.63 - got


def test_a_record_of_an_fp8_workload_is_planned_in_fp8():
    rec = {
        "status": "ok",
        "spec": {
            "workload": {"model": "tiny", "seq_len": 64, "global_batch_size": 4, "precision": "fp8"},
            "layout": {},
        },
        "metrics": {"step_time_s": {"median": 0.1}},
    }
    s = sample_from_record(rec)
    assert s.layout.precision == "fp8" and s.workload.dtype_bytes == 2


PLAN = ["plan", "--model", "tiny-4l", "--seq-len", "256", "--global-batch-size", "8", "--gpus", "8"]


def test_plan_json_names_the_precision(no_launch, capsys):
    assert cli([*PLAN, "--hardware", "h100-sxm", "--precision", "bf16,fp8", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["precision"] for r in rows} == {"bf16", "fp8"}
    assert cli([*PLAN, "--hardware", "h100-sxm", "--format", "json"]) == 0  # default: bf16 only
    assert {r["precision"] for r in json.loads(capsys.readouterr().out)} == {"bf16"}


def test_plan_table_shows_the_precision_only_when_asked_for_several(no_launch, capsys):
    assert cli([*PLAN, "--hardware", "h100-sxm", "--precision", "bf16,fp8", "--top", "40"]) == 0
    out = capsys.readouterr().out
    assert " prec " in out and " fp8 " in out and " bf16 " in out
    assert cli([*PLAN, "--hardware", "h100-sxm", "--top", "3"]) == 0
    assert " prec " not in capsys.readouterr().out


@pytest.mark.parametrize("hardware", ["a100-80gb", "a100-40gb", "cpu"])
def test_fp8_on_a_device_without_fp8_is_refused_in_one_line(no_launch, one_line_error, hardware):
    line = one_line_error(cli([*PLAN, "--hardware", hardware, "--precision", "bf16,fp8"]))
    assert line.startswith("error: --precision:") and hardware in line


def test_profiles_say_their_fp8_peak():
    assert H100.peak_tflops_fp8 == load_profile("h200").peak_tflops_fp8 == 1979
    assert not load_profile("a100-80gb").fp8
    assert np.isclose(H100.peak_flops_fp8(), 1979e12)


def test_a_profile_without_an_fp8_peak_takes_twice_bf16(tmp_path):
    path = tmp_path / "hw.yaml"
    path.write_text(
        "peak_tflops_bf16: 1000\nmemory_gib: 80\nhbm_gbps: 1\nnvlink_gbps: 1\ninternode_gbps: 1\ngpus_per_node: 8\n"
    )
    prof = load_profile(str(path))
    assert prof.fp8 and prof.peak_tflops_fp8 == 2000 and prof.eff("gemm_fp8") == 0.63


def test_an_emitted_sweep_runs_fp8_rows_as_fp8_points(no_launch, capsys):
    """A sweep's workload is bf16; an fp8 row is a point that sets its own workload.precision, and the
    sweep expands it into an fp8 run (the spec runs fp8 under own, fsdp, deepspeed)."""
    from harness.sweep.expand import expand
    from harness.sweep.spec import load_sweep

    assert cli([*PLAN, "--hardware", "h100-sxm", "--precision", "bf16,fp8", "--emit-sweep", "top.yaml"]) == 0
    text = (no_launch / "top.yaml").read_text()
    assert "workload.precision: fp8" in text
    points, _ = expand(load_sweep(str(no_launch / "top.yaml")))
    assert {p.spec["workload"]["precision"] for p in points} == {"bf16", "fp8"}
