"""MXFP8 (fp8_recipe mxfp8, harness/model/mxfp8.py): which linears are converted, the token padding that
lets a micro-batch (or an expert's share of one) of any length through torchao's 32-element blocks, the
engines that run it and the ones that refuse it, the tolerance and the planner's cast bytes. The parity of
the own engine (dp2, dp2 ep2) against the single-device reference under mxfp8 is in tests/test_engine_moe.py's
shared launch.
"""

import pytest
import torch

from harness.errors import SpecError
from harness.spec import parse_spec

MX = {"model": "tiny-moe", "seq_len": 16, "global_batch_size": 8, "precision": "fp8", "fp8_recipe": "mxfp8"}


def test_the_converted_linears_are_those_whose_widths_are_whole_blocks():
    from harness.model import float8, mxfp8
    from harness.model.llama import build_model
    from harness.model.presets import resolve_shape

    def converted(name):
        model = build_model(resolve_shape(name, {}), 0, "sdpa", "torch", "none", device="cpu")
        float8.convert(model, "mxfp8", "cpu")
        assert all(isinstance(m, mxfp8.Linear) for m in float8.float8_linears(model))
        return {n for n, m in model.named_modules() if m in float8.float8_linears(model)}

    attention = {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    # tiny: ffn 176 is no multiple of 32, so its MLP stays bf16 (under tensorwise it is converted: 176 = 11 x 16)
    assert converted("tiny") == attention
    experts = {
        f"layers.{i}.feed_forward.experts.{e}.{w}" for i in range(2) for e in range(8) for w in ("w1", "w3", "w2")
    }
    assert converted("tiny-moe") == attention | experts  # moe_ffn 96; not the routers (8 wide), not the head
    assert float8.align("mxfp8") == 32 and float8.align("rowwise") == 16


@pytest.mark.parametrize("rows", [0, 5, 16, 32, 37])
def test_any_number_of_tokens_runs_each_row_as_in_a_whole_block(rows):
    """torchao's MXFP8 matmul needs the tokens in whole blocks of 32 (its weight-gradient GEMM reduces over
    them); the harness pads zero rows. Forward casts run along a row (in_features), so each real row's
    output is bit for bit what it is inside a batch of 64; the weight gradient of the padded batch is the
    bf16 one within MXFP8's error, and an empty batch gives an empty output and a zero gradient."""
    from harness.model import mxfp8

    torch.manual_seed(0)
    mm = mxfp8.matmul("cpu")
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    w = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    full = mm(x, w).detach()
    part = x[:rows].clone().requires_grad_(True)
    y = mm(part, w)
    assert y.shape == (rows, 96) and torch.equal(y.detach(), full[:rows])
    g = torch.randn(rows, 96, dtype=torch.bfloat16)
    y.backward(g)
    exact = (g.float().t() @ part.detach().float()) if rows else torch.zeros(96, 64)
    if rows == 0:
        assert torch.equal(w.grad, torch.zeros_like(w))
    else:  # e4m3 on both operands of each product: within a few e4m3 steps (2^-3) of the bf16 gradient's scale
        assert (w.grad.float() - exact).abs().max() <= 2**-2 * exact.abs().max()
        assert part.grad.shape == part.shape


def test_every_mxfp8_cast_runs_inside_an_fp8_cast_range_and_no_gemm_does():
    """torchao's mx_mm casts six operands per linear and step (forward: the input and the weight along dim0;
    backward: the output gradient along dim0 and dim1, the weight and the input along dim1): each inside an
    FP8_CAST range (harness.model.mxfp8._range_casts), its GEMMs outside, as torchao.float8's are ranged."""
    from torch.profiler import ProfilerActivity, profile

    from harness.measure.ranges import FP8_CAST
    from harness.model import mxfp8

    mm = mxfp8.matmul("cpu")
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mm(x, w).sum().backward()
    events = prof.events()
    casts = [(e.time_range.start, e.time_range.end) for e in events if e.name == FP8_CAST]
    gemms = [(e.time_range.start, e.time_range.end) for e in events if e.name == "aten::mm"]
    assert len(casts) == 6 and len(gemms) >= 3  # forward, input gradient, weight gradient
    assert not [g for g in gemms if any(a <= g[0] and g[1] <= b for a, b in casts)]


def test_an_mxfp8_run_says_how_much_of_its_compute_the_casts_took(tmp_path):
    """In process, one rank, fp8_recipe mxfp8 (tiny: its attention linears converted): the profiled step's
    breakdown carries the MXFP8 casts' time, a part of compute, as an fp8 tensorwise run's does."""
    from harness.run import run
    from harness.runtime import RunContext

    cpu = RunContext(0, 1, 0, torch.device("cpu"), None)
    workload = {"seq_len": 16, "global_batch_size": 2, "steps": 1, "warmup_steps": 1}
    spec = parse_spec(
        {"workload": {**workload, "precision": "fp8", "fp8_recipe": "mxfp8"}, "store": str(tmp_path / "r.sqlite")}
    )
    m = run(spec, cpu, progress=False, profile_steps=1, trace_dir=None)["metrics"]
    assert 0 < m["compute_fp8_cast_ms"] < m["breakdown_ms"]["compute"]


@pytest.mark.parametrize("engine", ["own", "single", "fsdp"])
def test_the_engines_that_run_fp8_run_mxfp8(engine):
    lay = {"engine": engine, **({} if engine == "single" else {"dp": 2})}
    spec = parse_spec({"workload": MX, "layout": lay})
    assert spec.workload.fp8_recipe == "mxfp8"


def test_mxfp8_refusals_are_one_line():
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": MX, "layout": {"engine": "deepspeed", "dp": 2, "zero_stage": 1}})
    assert str(e.value) == "workload.fp8_recipe: engine deepspeed runs tensorwise, rowwise only"
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": MX, "layout": {"engine": "fsdp", "dp": 2, "fp8_all_gather": True}})
    assert str(e.value).endswith("mxfp8 scales per block of 32)")
    # the own engine under tp: each shard's widths must be whole blocks too (tiny-moe's moe_ffn 96 / 2 = 48)
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": MX, "layout": {"engine": "own", "tp": 2}})
    assert str(e.value).startswith("workload.precision: fp8 with tp > 1")


def test_the_mxfp8_tolerance_is_fp8s_with_the_block_scale_term():
    from harness.compare.spec import DEFAULT_TOLERANCE
    from harness.testing.equivalence import FP8_LOSS_RTOL, MXFP8_LOSS_RTOL

    assert MXFP8_LOSS_RTOL == pytest.approx(FP8_LOSS_RTOL * (17 / 16) ** 0.5)
    assert DEFAULT_TOLERANCE["mxfp8"] == pytest.approx(DEFAULT_TOLERANCE["fp8"] * (17 / 16) ** 0.5, rel=0.01)


def test_the_planner_casts_mxfp8_as_torchaos_roofline_does():
    """torchao's roofline (testing/training/roofline_utils.py, mxfp8_cublas): every operand, activation or
    weight, cast twice (dim0 and dim1), each a bf16 read and an fp8 write: 2B + 2 bytes per element."""
    from harness.planner import fp8

    assert fp8.CAST_BYTES["mxfp8"]["activation"](2) == fp8.CAST_BYTES["mxfp8"]["weight"](2) == 6
