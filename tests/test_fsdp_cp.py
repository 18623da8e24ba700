"""engine fsdp's context parallelism (torch's context_parallel): refused on CPU in one line before
anything is built (torch 2.13's SDPA dispatch has no CPU kernel), what does not combine with it
refused by the spec, and torch's head-tail sharding is cp_token_index's."""

import pytest
import torch

from harness import registry
from harness.errors import SpecError
from harness.model.llama import cp_token_index
from harness.spec import parse_spec
from harness.testing.workloads import tiny_workload

WORKLOAD = tiny_workload(global_batch_size=4, warmup_steps=0)


CP_LAYOUT = dict(engine="fsdp", cp=2, cp_impl="allgather", dp=1, micro_batch_size=2, attention="sdpa")


def cp_layout(**layout) -> dict:
    """CP_LAYOUT (engine fsdp at cp 2, allgather, sdpa) with `layout` changed or added."""
    return {**CP_LAYOUT, **layout}


def cp_spec(device="cpu", **layout):
    return parse_spec({"workload": {**WORKLOAD, "device": device}, "layout": cp_layout(**layout)})


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cp_refused_on_cpu_before_anything_is_built(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = cp_spec(device)  # the spec itself is fine: the device decides
    with pytest.raises(SpecError) as e:
        registry.facts("fsdp").preflight(spec)
    assert e.value.field == "layout.cp"
    assert "CUDA only" in e.value.reason and "_scaled_dot_product_flash_attention_for_cpu" in e.value.reason
    assert "\n" not in e.value.reason


def test_cp_passes_the_preflight_on_cuda_and_cp1_on_cpu():
    registry.facts("fsdp").preflight(cp_spec("cuda"))
    registry.facts("fsdp").preflight(cp_spec("cpu", cp=1))


@pytest.mark.parametrize(
    "layout,field,words",
    [
        ({"cp_impl": "ulysses"}, "layout.cp_impl", "not Ulysses"),
        ({"attention": "naive"}, "layout.attention", "scaled_dot_product_attention only"),
        ({"pp": 2}, "layout.cp", "pipelining"),
        ({"tp": 2, "model": "tiny-4l"}, "layout.cp", "tensor parallelism"),
    ],
    ids=["ulysses", "naive", "pp", "tp"],
)
def test_what_does_not_combine_with_context_parallel_refused(layout, field, words):
    model = layout.pop("model", "tiny")
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": {**WORKLOAD, "model": model}, "layout": cp_layout(**layout)})
    assert e.value.field == field and words in e.value.reason


@pytest.mark.parametrize("cp", [2, 4])
def test_torch_head_tail_sharding_is_cp_token_index(cp):
    """context_parallel's default load balancer puts rank r's shard at rows [r s/cp, (r+1) s/cp) of
    the rearranged sequence: the same tokens, in the same order, as cp_token_index."""
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    seq = 32
    order = _HeadTailLoadBalancer(seq, cp, "cpu")._generate_indices().reshape(cp, -1)
    for r in range(cp):
        assert order[r].tolist() == cp_token_index(seq, cp, r).tolist()


def test_a_comparison_refuses_fsdp_cp_on_cpu_before_it_launches_and_a_matrix_shows_the_dash():
    from harness.compare.spec import parse_compare_spec

    workload = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 5, "device": "cpu"}
    with pytest.raises(SpecError) as e:
        parse_compare_spec({"name": "c", "nproc": 2, "workload": workload, "runs": [{"engine": "fsdp", "cp": 2}]})
    assert e.value.field == "runs[0].cp" and "CUDA only" in e.value.reason
    cs = parse_compare_spec(
        {
            "name": "c",
            "nproc": 2,
            "workload": workload,
            "matrix": {"engines": [{"engine": "own"}, {"engine": "fsdp"}], "layouts": [{"cp": 2}]},
        }
    )
    assert [p.label for p in cs.runs] == ["reference (single device)", "own cp2 ring"]
    (dash,) = cs.not_runnable
    assert dash["label"] == "FSDP2 reshard cp2 ring" and dash["why"].startswith("layout.cp: torch's context_parallel")
