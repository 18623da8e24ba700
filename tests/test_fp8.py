"""FP8 training as a precision policy (precision fp8: torchao's float8 linears, harness/model/float8.py):
what the spec refuses, which linears are converted, the reference's census against the policy's closed
form, and (slow) one comparison of the engines that run it against the single-device reference.
"""

import os

import pytest
import torch

from harness.errors import SpecError
from harness.spec import parse_spec
from harness.testing.workloads import tiny_workload

FP8 = tiny_workload(precision="fp8", seq_len=16, global_batch_size=4)


def _refusal(workload: dict, layout: dict) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": workload, "layout": layout})
    return str(e.value)


@pytest.mark.parametrize(
    "workload, layout, line",
    [
        (
            tiny_workload(fp8_recipe="rowwise"),
            {},
            "workload.fp8_recipe: applies only with precision: fp8, and precision is fp32: set precision: fp8",
        ),
        (
            FP8,
            {"engine": "own", "dp": 2, "fp8_all_gather": True},
            "layout.fp8_all_gather: FSDP2's FP8 all-gather (torchao enable_fsdp_float8_all_gather) is for engine fsdp",
        ),
        (
            {**FP8, "fp8_recipe": "rowwise"},
            {"engine": "fsdp", "dp": 2, "fp8_all_gather": True},
            "layout.fp8_all_gather: needs fp8_recipe: tensorwise (torchao all-gathers FP8 weights with one scale per "
            "tensor; rowwise scales per row)",
        ),
        (
            tiny_workload(precision="bf16"),
            {"engine": "fsdp", "dp": 2, "fp8_all_gather": True},
            "layout.fp8_all_gather: needs precision: fp8, and precision is bf16",
        ),
    ],
)
def test_fp8_fields_are_refused_where_they_mean_nothing(workload, layout, line):
    assert _refusal(workload, layout) == line


def test_engines_refuse_fp8_where_they_do_not_run_it():
    """tiny's ffn 176 / tp 2 = 88 is no multiple of 16: the own engine would leave the MLP in bf16."""
    assert _refusal(FP8, {"engine": "own", "tp": 2}).startswith("workload.precision: fp8 with tp > 1: the own engine")
    fsdp = _refusal(FP8, {"engine": "fsdp", "tp": 2})
    assert fsdp.startswith("workload.precision: fp8 with tp > 1 under engine fsdp")
    assert _refusal(FP8, {"engine": "deepspeed", "tp": 2, "zero_stage": 1}).startswith(
        "workload.precision: fp8 under engine deepspeed"
    )


def test_megatron_refuses_fp8_in_one_line_before_launch(no_launch, one_line_error):
    """Megatron-core's FP8 is Transformer Engine's; engine megatron builds the local layer spec without it."""
    import yaml

    from harness.cli import main as cli_main

    (no_launch / "s.yaml").write_text(yaml.safe_dump({"workload": FP8, "layout": {"engine": "megatron", "dp": 2}}))
    line = one_line_error(cli_main(["train", "s.yaml"]))
    assert line.startswith("error: workload.precision: Megatron-core runs FP8 only through Transformer Engine")


def test_the_converted_linears_are_the_blocks_not_the_head_nor_misaligned_ones():
    from harness.model import float8
    from harness.model.llama import build_model
    from harness.model.presets import resolve_shape

    model = build_model(resolve_shape("tiny", {}), 0, "sdpa", "torch", "none", device="cpu")
    float8.convert(model, "tensorwise", "cpu")
    converted = {n for n, m in model.named_modules() if m in float8.float8_linears(model)}
    parts = [f"attention.{w}" for w in ("wq", "wk", "wv", "wo")] + [f"feed_forward.{w}" for w in ("w1", "w3", "w2")]
    assert converted == {f"layers.{i}.{part}" for i in range(2) for part in parts}
    assert not float8.converts(torch.nn.Linear(64, 24), "layers.0.attention.wq")  # 24: no multiple of 16
    # a MoE's router stays out whatever its width (16 experts: aligned), as torchtitan's filter leaves it
    assert float8.converts(torch.nn.Linear(64, 16), "layers.0.feed_forward.experts.0.w1")
    assert not float8.converts(torch.nn.Linear(64, 16), "layers.0.feed_forward.router")
    assert not float8.converts(torch.nn.Linear(64, 16), "layers.0.feed_forward.deepspeed_moe.gate.wg")
    assert float8.backend("cpu") in ("scaled_mm", "emulated")


def _census_after_one_step(precision: str):
    from harness.data.source import token_source
    from harness.frameworks.single.engine import SingleDeviceEngine

    spec = parse_spec({"workload": {**FP8, "precision": precision}, "layout": {"micro_batch_size": 2}})
    engine = SingleDeviceEngine(spec, spec.shape(), torch.device("cpu"))
    engine.train_step(token_source(spec.workload, spec.shape().vocab).global_batch_at(0))
    return engine


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_reference_census_is_the_policys_closed_form(precision):
    """The census at the first optimizer step against PrecisionPolicy.reference_census, within 3% per
    category and dtype (exact here: every tensor is counted once, unpadded). Under fp8 nothing FP8
    persists (fp8_persistent_bytes: 0 without FSDP2's FP8 all-gather), so both policies hold the same."""
    from harness.model import float8
    from harness.model.presets import param_count

    engine = _census_after_one_step(precision)
    shape = engine.spec.shape()
    expected = engine.policy.reference_census(param_count(shape), len(engine.names))
    census = {k: v for k, v in engine.memory_census().items() if v}
    assert set(census) == set(expected)
    for category, by_dtype in expected.items():
        assert set(census[category]) == set(by_dtype), category
        for dtype, n in by_dtype.items():
            assert abs(census[category][dtype] - n) <= 0.03 * n, (category, dtype, census[category][dtype], n)
    if precision == "fp8":
        assert len(float8.float8_linears(engine.model)) == 7 * shape.layers
        assert engine.policy.fp8_persistent_bytes(7 * shape.layers) == 0
        assert engine.describe()["fp8_backend"] == float8.backend("cpu")
        assert "FP8" in engine.policy.describe()


def test_an_fp8_comparison_plans_a_bf16_reference_beside_it_outside_parity():
    from harness.compare.spec import BF16_BASELINE, load_compare_spec

    cs = load_compare_spec(os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-fp8.yaml"))
    baseline = [r for r in cs.runs if r.baseline]
    assert [r.label for r in baseline] == [BF16_BASELINE]
    assert baseline[0].spec.workload.precision == "bf16" and baseline[0].spec.layout.engine == "single"
    assert {r.spec.layout.engine for r in cs.runs if not r.baseline and not r.is_reference} == {
        "own",
        "fsdp",
        "deepspeed",
    }
    assert cs.tolerance == 5.7e-3


def test_the_record_names_the_fp8_recipe_and_backend():
    from harness.store.fields import row

    record = {
        "spec": {"workload": {"precision": "fp8", "fp8_recipe": "rowwise"}},
        "metrics": {"engine": {"fp8_backend": "scaled_mm"}},
    }
    assert row(record)["fp8_recipe"] == "rowwise" and row(record)["fp8_backend"] == "scaled_mm"
    assert row({"spec": {"workload": {"precision": "bf16", "fp8_recipe": "tensorwise"}}})["fp8_recipe"] is None


# The example's 4 measured steps cut to 2 (3 trained with the warm-up, and 1 profiled step, not 2): every
# step of every run multiplies FP8 GEMMs in aten::_scaled_mm, whose CPU kernel is slow (the reference's
# step on one thread: 2.3 s CPU, 95% of it in _scaled_mm; in bf16 0.03 s). The bound below is a maximum
# over the steps compared, so it holds on the first 3 of 5.
STEPS = 2


@pytest.mark.slow
def test_fp8_engines_match_the_fp8_reference(tmp_path):
    """One comparison (examples/compare-cpu-fp8.yaml's runs, 2 processes, over STEPS measured steps): own
    dp2, FSDP2 dp2 with the FP8 all-gather and DeepSpeed ZeRO-1 under tensorwise FP8 against the
    single-device reference under the same recipe, at the tolerance 5.7e-3 = bf16's 1e-3 x sqrt(2^5),
    derived so:

    - every engine casts the reference's tensors: the reference runs the same micro-batches
      (micro_batch_size 2, 4 of them; each rank 2), so each dynamic scale is the amax of the same
      activation, weight (replicated; FSDP2's gathered bf16 one) or output gradient, the latter up to the
      factor 2 between a rank's loss scaling (1/2 micro-batches, averaged over dp=2) and the reference's
      (1/4): amax scales are equivariant under a power of two, so the FP8 values are bit-identical as
      long as the bf16 tensors are. What differs is bf16's difference (the fp32 reduction order, within
      bf16's 1e-3), and e4m3 amplifies it: where a bf16 value moves by one bf16 step u (2^-8 relative)
      its FP8 cast moves by one e4m3 step (2^-3 = 2^5 u) with probability 2^-5, else not at all: the
      same mean, and 2^5 times bf16's variance; rounding errors of independent sign add in variance,
      so the loss deviation is sqrt(2^5) = 5.7 times bf16's (measured: FSDP2 dp2 1.3e-5 under bf16,
      3.8e-5 to 8.6e-5 under fp8; own 2.6e-7, DeepSpeed 8.6e-8).
    - FSDP2's FP8 all-gather casts the fp32 shard with the fp32 weight's amax (torchao's
      fsdp_pre_all_gather), the reference the bf16 parameter with its amax: a second quantization of the
      weights, differing where the scale ratio (within 1 +- 2^-8) or the double rounding moves an element
      across an e4m3 rounding boundary: one e4m3 step s on about 2^-8 / 2^-4 = 1/16 of the elements,
      variance s^2/16 per element, against s^2/12 for the quantization error of every element of each of
      the three casts (input, weight, output gradient) that make the fp8-vs-bf16 difference d. Rounding
      errors of independent sign add in variance, so the all-gather run's loss deviation is about
      sqrt((1/16) / (3/12)) = 1/2 of d; over 5 steps the worst at most ~3 sigma: 1.5 d, on top of the
      amplified bf16 difference above (over fewer steps, a maximum of fewer). The bound holds where
      2 d < tolerance: asserted here as its premise, d measured by the comparison's bf16 reference over
      the steps compared (the example's markov data, lr 1e-3, all 5 steps: d = 2.9e-4; the all-gather
      run 1.4e-4, its gradient norms 9.2e-4).
    Its census is FSDP2's closed form at dp=2 (tests/test_census_fsdp.py) plus one fp32 scale per
    converted weight (PrecisionPolicy.fp8_persistent_bytes), within 3%.
    """
    from harness.compare.orchestrate import run_comparison
    from harness.model.presets import param_count, resolve_shape
    from harness.model.training import precision_policy
    from harness.store import PASS
    from harness.testing.workloads import example_over

    cs = example_over(os.path.join(os.path.dirname(__file__), "..", "examples", "compare-cpu-fp8.yaml"), STEPS)
    summary = run_comparison(
        cs, store_path=str(tmp_path / "r.sqlite"), progress=False, log_dir=str(tmp_path), profile_steps=1
    )
    assert len(summary["loss_curves"]["reference (single device)"]) == 1 + STEPS  # warm-up + measured
    assert summary["verdict"] == PASS, [(r["label"], r["status"], r.get("error_line")) for r in summary["runs"]]
    cost = summary["fp8_vs_bf16"]
    assert 0 < 2 * cost["max_rel_diff"] < cs.tolerance  # FP8 ran (its losses are not bf16's); the bound's premise
    shape = resolve_shape("tiny", {})
    p, tensors, d, linears = param_count(shape), 2 + 9 * shape.layers + 1, 2, 7 * shape.layers
    policy = precision_policy(parse_spec({"workload": cs.workload}).workload)
    fsdp = next(r for r in summary["runs"] if r["engine"] == "fsdp")
    census = {k: v for k, v in fsdp["metrics"]["memory_census"].items() if v}
    expected = {
        "parameters": {"fp32": 4 * p // d},
        "gradients": {"fp32": 4 * p // d},
        "optimizer_states": {"fp32": 8 * p // d + 4 * tensors},
        "fp8": {"fp32": policy.fp8_persistent_bytes(linears, fsdp_all_gather=True)},
    }
    assert set(census) == set(expected)
    for category, by_dtype in expected.items():
        for dtype, n in by_dtype.items():
            assert abs(census[category][dtype] - n) <= 0.03 * n, (category, dtype, census[category], n)
    assert all(r["describe"]["fp8_backend"] for r in summary["runs"] if not r["baseline"])


def test_harness_memory_refuses_fp8_in_one_line():
    """The memory trace builds engines on fake tensors, where torchao's Float8Linear is not built here."""
    from harness.memtrace.trace import check_traceable

    spec = parse_spec({"workload": FP8, "layout": {"engine": "own", "dp": 2}})
    with pytest.raises(SpecError) as e:
        check_traceable(spec)
    assert str(e.value).startswith("workload.precision: harness memory does not trace fp8")
