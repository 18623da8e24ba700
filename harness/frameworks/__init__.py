"""One adapter per engine behind one small interface, so the runner treats them alike.

An engine is built by `build_engine(spec, shape, ctx)` and offers:
  train_step(global_batch) -> Tensor  one optimizer step on the step's global batch
                                      [global_batch_size, seq_len + 1]; returns the global mean
                                      loss (the same number on every rank)
  full_state_dict() -> dict | None    gathered fp32 parameters named as the plain Llama's,
                                      on global rank 0 (None elsewhere); for equivalence checks
  last_step_details() -> dict         optional extras of the last step: breakdown_s, comm,
                                      pipeline_timeline (missing keys mean not measured)
  describe() -> dict                  what the record should say about the engine
  memory_census() -> dict | None      bytes per category (parameters, gradients, master_parameters,
                                      optimizer_states) and dtype that this rank held at its first
                                      optimizer step (harness.measure.CensusAtStep over the tensors
                                      the engine really holds); None: not measured
  activation_exclusions() -> list     tensors autograd may save that are not activations (the
                                      parameters, and any gathered copies of them)

Every engine follows the workload's precision policy (harness.model.training.PrecisionPolicy);
where a framework cannot, the spec refuses the combination (harness.spec.PRECISION_LIMITS).
"""

from __future__ import annotations

import importlib

ADAPTERS = {
    "single": "harness.frameworks.single",
    "own": "harness.frameworks.own",
    "deepspeed": "harness.frameworks.deepspeed_adapter",
    "fsdp": "harness.frameworks.fsdp",
}


def build_engine(spec, shape, ctx):
    module = importlib.import_module(ADAPTERS[spec.layout.engine])
    return module.build(spec, shape, ctx)
