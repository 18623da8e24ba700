"""FSDP2's fp32 sharded parameters are its master copy: under bf16 they must start equal to the reference's
masters (copied from its bf16 parameters), or every engine but FSDP2 starts from bf16-rounded masters and
FSDP2's losses and gradient norms leave the others' from the second step on. No processes: the plain
(non-DTensor) path of the loader, on a module as FSDP2 holds it before fully_shard."""

import pytest
import torch

from harness.frameworks.fsdp.engine import _load_reference_shards
from harness.frameworks.single.engine import SingleDeviceEngine
from harness.model.llama import Llama, ReferenceWeights
from harness.spec import parse_spec
from harness.testing.workloads import tiny_workload


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp8"])
def test_fsdp2_initial_masters_are_the_references(precision):
    spec = parse_spec({"workload": tiny_workload(precision=precision), "layout": {"engine": "single"}})
    shape = spec.shape()
    reference = SingleDeviceEngine(spec, shape, torch.device("cpu"))
    masters = dict(zip(reference.names, reference.weights.optimizer_params(), strict=True))
    module = Llama(shape)  # fp32, as FSDP2's sharded parameters
    with torch.no_grad():
        through = reference.policy.compute if reference.policy.master is not None else None  # as FSDPEngine calls it
        _load_reference_shards(module, ReferenceWeights(shape, spec.workload.seed), through)
    for name, param in module.named_parameters():
        assert param.dtype == torch.float32, name
        assert torch.equal(param.detach(), masters[name].detach().float()), name
    if precision != "fp32":  # the rounding is what the test is about: the unrounded weights differ
        weight = ReferenceWeights(shape, spec.workload.seed)["layers.0.attention.wq.weight"]
        assert not torch.equal(weight, masters["layers.0.attention.wq.weight"].detach())
