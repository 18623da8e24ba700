"""The seams an engine's build offers a caller that is not a real run (harness memory): the
optimizer factory and the step's phase hooks (harness.model.training.BuildOptions, StepHooks),
train_step's loss as a tensor, and no patching or source reading left in the product."""

from __future__ import annotations

import pathlib
import re

import torch

from harness.testing import equivalence as E

ROOT = pathlib.Path(__file__).resolve().parent.parent / "harness"


class Recorder:
    """StepHooks that write down what the engine told them, in order."""

    def __init__(self):
        self.calls = []

    def forward(self, where):
        self.calls.append(where)

    def forward_end(self):
        self.calls.append("end")

    def backward(self, where):
        self.calls.append(where)

    def optimizer(self, where):
        self.calls.append("optimizer")


def test_own_engine_tells_its_phases_and_takes_the_optimizer_factory():
    from harness.engine.adapter import build
    from harness.engine.engine import Engine3D
    from harness.model.training import BuildOptions, make_adamw
    from harness.runtime import RunContext

    spec = E.make_spec({"layout": {"micro_batch_size": 4}})  # 2 micro-batches, no pipeline
    shape = spec.shape()
    made = []

    def factory(params, workload, **kw):
        made.append(kw)
        return make_adamw(params, workload, **kw)

    hooks = Recorder()
    ctx = RunContext(0, 1, 0, torch.device("cpu"), None)
    eng = Engine3D(spec, shape, ctx, options=BuildOptions(make_optimizer=factory, hooks=hooks))
    assert made == [{"fused": False}]
    batch = E.batches(spec, shape, 1)[0]
    loss = eng.train_step(batch)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert hooks.calls == [
        "forward chunk 0 micro-batch 0",
        "end",
        "backward chunk 0 micro-batch 0",
        "forward chunk 0 micro-batch 1",
        "end",
        "backward chunk 0 micro-batch 1",
        "optimizer",
    ]
    plain = build(spec, shape, ctx)  # the default build: the same step, the same loss
    assert float(plain.train_step(batch)) == float(loss)


def test_harness_neither_patches_nor_reads_its_source():
    """No module reads source text at run time or patches code with unittest.mock: what the trace
    changes goes through the engines' build-time seams (BuildOptions: kernels, optimizer, transfers)."""
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        assert "linecache" not in text, path
        # unittest.mock in any spelling (Megatron-LM's `--mock-data` flag is data, not patching)
        assert not re.search(r"unittest\.mock|from unittest import|^\s*import mock|from mock import", text, re.M), path
