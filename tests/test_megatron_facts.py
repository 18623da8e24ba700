"""Engine megatron without processes: what it refuses before launch (its ENGINE facts, through the spec and
`harness train`, one line and exit code 2), its adapter staying light, the weights mapping (Megatron's fused
QKV interleaved per query group, the gated MLP's per-rank halves) and the CPU device shim with its tripwire.
Parity, the census and the shim on real steps: tests/test_megatron.py."""

from __future__ import annotations

import pytest
import yaml

from harness.cli import main as cli_main
from harness.errors import SpecError
from harness.spec import parse_spec

TINY = {
    "model": "tiny",
    "model_overrides": {"layers": 4},
    "seq_len": 16,
    "global_batch_size": 8,
    "steps": 1,
    "warmup_steps": 0,
    "device": "cpu",
}
OK = {"engine": "megatron", "attention": "naive"}

REFUSED = [  # (layout, workload overrides, field, reason)
    ({"attention": "sdpa"}, {}, "layout.attention", "DotProductAttention"),
    ({"rmsnorm": "fused"}, {}, "layout.rmsnorm", "Transformer Engine or Apex"),
    ({"dp": 2, "zero_stage": 2}, {}, "layout.zero_stage", "ZeRO-2/3 is Megatron-FSDP"),
    ({"pp": 2, "pipeline_schedule": "gpipe"}, {}, "layout.pipeline_schedule", "no gpipe"),
    ({"pp": 2, "pipeline_schedule": "interleaved"}, {}, "layout.virtual_stages", "virtual_stages > 1"),
    ({"ds_config": "ds_configs/zero1.json"}, {}, "layout.ds_config", "only for engine deepspeed"),
    ({"model_impl": "hf"}, {}, "layout.model_impl", "for engine deepspeed"),
    ({"pipeline_p2p": "async"}, {}, "layout.pipeline_p2p", "engine megatron has its own"),
    ({}, {"precision": "bf16", "grad_accum_dtype": "bf16"}, "workload.grad_accum_dtype", "one dtype for both"),
    (
        {},
        {"model_overrides": {"layers": 4, "rope_factor": 8.0, "rope_high_freq_factor": 2.0}},
        "workload.model",
        "high_freq_factor 4",
    ),
    (
        {"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2},
        {"model_overrides": {"layers": 6}},
        "workload.model",
        "layers: engine megatron splits the layers evenly",
    ),
]


def _raw(layout: dict, workload: dict) -> dict:
    return {"workload": {**TINY, **workload}, "layout": {**OK, **layout}}


@pytest.mark.parametrize("layout,workload,field,reason", REFUSED, ids=[r[2] + "-" + r[3][:12] for r in REFUSED])
def test_refused_before_launch(layout, workload, field, reason):
    with pytest.raises(SpecError) as e:
        parse_spec(_raw(layout, workload))
    assert e.value.field == field and reason in e.value.reason, (e.value.field, e.value.reason)


@pytest.mark.parametrize(
    "layout,workload,field,reason", REFUSED[:2] + REFUSED[8:9], ids=["attention", "rmsnorm", "grad-dtypes"]
)
def test_refused_through_harness_train(no_launch, one_line_error, layout, workload, field, reason):
    (no_launch / "m.yaml").write_text(yaml.safe_dump(_raw(layout, workload)))
    line = one_line_error(cli_main(["train", "m.yaml"]))
    assert line.startswith(f"error: {field}: ") and reason in line, line


@pytest.mark.parametrize(
    "layout,workload",
    [
        ({"tp": 2, "sequence_parallel": True, "pp": 2, "dp": 2, "zero_stage": 1}, {}),
        ({"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2, "activation_checkpointing": "full"}, {}),
        ({"pp": 2}, {"model_overrides": {"layers": 4, "tie_embeddings": True}}),  # Megatron's embedding group
        ({"dp": 2}, {"precision": "bf16", "grad_accum_dtype": "bf16", "grad_reduce_dtype": "bf16"}),
        ({"tp": 2}, {"model_overrides": {"layers": 4, "rope_factor": 8.0, "attention_bias": True}}),
    ],
    ids=["3d", "interleaved-full", "tied-pp2", "bf16-grads", "llama3-bias"],
)
def test_taken(layout, workload):
    parse_spec(_raw(layout, workload))


def test_label_names_the_distributed_optimizer():
    from harness.spec import engine_variant

    assert engine_variant({"engine": "megatron", "zero_stage": 1}) == "megatron DistOpt"
    assert engine_variant({"engine": "megatron"}) == "megatron"


def test_the_version_ranges_are_pinned():
    """0.17+ declare Python >= 3.12: 0.16 before it, 0.19 from it (with triton, which 0.19 imports unguarded);
    the engine and its shim are tested against 0.16.1 and 0.19.2 and no other minor version."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert "\"megatron-core>=0.16,<0.17; python_version < '3.12'\"" in text
    assert "\"megatron-core>=0.19,<0.20; python_version >= '3.12'\"" in text
    assert "\"triton; python_version >= '3.12' and sys_platform == 'linux'\"" in text


def test_the_installed_megatron_core_is_the_one_this_python_asks_for():
    """The installed version is in the range that the harness's own requirements pick for this Python (a
    venv made before the pins moved, or one Python's packages under another's, shows up here)."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    wanted = [Requirement(r) for r in requires("llama-layout-harness")]
    mine = [r for r in wanted if r.name == "megatron-core" and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    assert len(mine) == 1, wanted
    assert mine[0].specifier.contains(version("megatron-core")), (version("megatron-core"), str(mine[0]))


# ---------------------------------------------------------------- weights mapping


def test_weights_round_trip_through_megatrons_layout_per_tp_rank():
    """Plain -> each tp rank's Megatron part -> plain gives the plain tensors back, and the fused QKV part
    of a rank is its query groups, each [its queries, its key, its value] (Megatron's get_query_key_value_tensors
    splits it so)."""
    import torch

    from harness.frameworks.megatron.weights import megatron_shard, plain_tensors
    from harness.model.presets import resolve_shape

    shape = resolve_shape("tiny", {"attention_bias": True})
    hd, per = shape.hidden // shape.heads, shape.heads // shape.kv_heads
    g = torch.Generator().manual_seed(0)
    cases = {
        "decoder.layers.0.self_attention.linear_qkv.weight": [
            torch.randn(shape.heads * hd, shape.hidden, generator=g),
            torch.randn(shape.kv_heads * hd, shape.hidden, generator=g),
            torch.randn(shape.kv_heads * hd, shape.hidden, generator=g),
        ],
        "decoder.layers.0.self_attention.linear_qkv.bias": [
            torch.randn(shape.heads * hd, generator=g),
            torch.randn(shape.kv_heads * hd, generator=g),
            torch.randn(shape.kv_heads * hd, generator=g),
        ],
        "decoder.layers.0.mlp.linear_fc1.weight": [
            torch.randn(shape.ffn, shape.hidden, generator=g),
            torch.randn(shape.ffn, shape.hidden, generator=g),
        ],
        "decoder.layers.0.mlp.linear_fc2.weight": [torch.randn(shape.hidden, shape.ffn, generator=g)],
        "decoder.layers.0.self_attention.linear_proj.bias": [torch.randn(shape.hidden, generator=g)],
        "output_layer.weight": [torch.randn(shape.vocab, shape.hidden, generator=g)],
    }
    for tp in (1, 2):
        for name, plain in cases.items():
            shards = [megatron_shard(name, plain, shape, tp, r) for r in range(tp)]
            for got, want in zip(plain_tensors(name, shards, shape), plain, strict=True):
                assert torch.equal(got, want), (name, tp)
    q, k, v = cases["decoder.layers.0.self_attention.linear_qkv.weight"]
    rank1 = megatron_shard("decoder.layers.0.self_attention.linear_qkv.weight", [q, k, v], shape, 2, 1)
    group = shape.kv_heads // 2  # rank 1's first query group
    assert torch.equal(rank1[: per * hd], q[group * per * hd : (group + 1) * per * hd])
    assert torch.equal(rank1[per * hd : (per + 1) * hd], k[group * hd : (group + 1) * hd])
    assert torch.equal(rank1[(per + 1) * hd : (per + 2) * hd], v[group * hd : (group + 1) * hd])
    w1, w3 = cases["decoder.layers.0.mlp.linear_fc1.weight"]
    fc1 = megatron_shard("decoder.layers.0.mlp.linear_fc1.weight", [w1, w3], shape, 2, 1)
    assert torch.equal(fc1, torch.cat([w1[shape.ffn // 2 :], w3[shape.ffn // 2 :]]))


# ---------------------------------------------------------------- the device shim


def test_the_shim_answers_cuda_with_the_cpu_only_while_active():
    import torch

    from harness.frameworks.megatron import shim as megatron_shim

    current_device = torch.cuda.current_device
    with megatron_shim.active():
        t = torch.zeros(2, device="cuda")
        assert t.device.type == "cpu" and t.cuda() is t and t.to("cuda").device.type == "cpu"
        assert torch.ones(1, device=torch.device("cuda", 0)).device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor" and t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.synchronize()
        state = torch.get_rng_state()
        torch.cuda.manual_seed(7)
        assert not torch.equal(torch.cuda.get_rng_state(), state)  # the CPU generator stands in for CUDA's
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.get_rng_state(), state)
    assert torch.cuda.current_device is current_device
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_the_tripwire_records_uncovered_cuda_calls():
    """What tests/test_megatron.py relies on to fail when Megatron reaches a CUDA call the shim does not cover."""
    import torch

    from harness.frameworks.megatron import shim as megatron_shim

    with megatron_shim.tripwire() as reached:
        with megatron_shim.active():
            torch.cuda.synchronize()  # covered
            torch.cuda.is_available()  # harmless, recorded
            torch.cuda.memory_allocated()  # neither: recorded (on a CPU build it quietly answers 0)
    assert reached == {"is_available", "memory_allocated"}
    assert set(reached) - set(megatron_shim.HARMLESS) == {"memory_allocated"}


def test_every_record_names_the_megatron_core_it_ran_with():
    """The fingerprint (every record's) and the report's version column carry megatron-core's version,
    as they carry DeepSpeed's: two runs on different Megatron releases are flagged, not compared silently."""
    import importlib.metadata

    import torch

    from harness.measure.fingerprint import fingerprint

    assert fingerprint(torch.device("cpu"), 1)["megatron_core"] == importlib.metadata.version("megatron-core")


def test_the_shim_answers_the_moe_dispatchers_streams_and_host_copies():
    """The alltoall dispatcher's side stream (torch.cuda.Stream, current_stream, stream, wait_stream,
    record_event().synchronize()), its split sizes made numpy from CPU tensors as from CUDA ones, and the
    router's te_general_gemm bound to None without Transformer Engine: only while active."""
    import numpy as np
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    from harness.frameworks.megatron import shim as megatron_shim

    had_gemm = hasattr(moe_utils, "te_general_gemm")
    with megatron_shim.active():
        side = torch.cuda.Stream()
        assert torch.cuda.current_stream() is not side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        side.record_event().synchronize()
        assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
        counts = torch.tensor([2, 2])
        assert moe_utils.maybe_move_tensor_to_cpu(counts) is counts  # tensors stay tensors unless asked
        assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is not None
        if not had_gemm:
            assert moe_utils.te_general_gemm is None
            logits = moe_utils.router_gating_linear(torch.ones(3, 4), torch.ones(2, 4), None, torch.float32)
            assert torch.equal(logits, torch.full((3, 2), 4.0))
    assert hasattr(moe_utils, "te_general_gemm") == had_gemm
    assert token_dispatcher.maybe_move_tensor_to_cpu is moe_utils.maybe_move_tensor_to_cpu
    assert not isinstance(moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1]), as_numpy=True), np.ndarray)
