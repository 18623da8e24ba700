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
where a framework cannot, the spec refuses the combination (the adapter's ENGINE.precision_limits).

Each adapter declares at its top `ENGINE = harness.registry.EngineFacts(...)`: what it runs, its
precision and model limits, its label. harness.registry maps each engine's name to its adapter.
An adapter stays light (no torch at import: the spec and the reports read its facts) and its
build() imports the engine: own -> harness/engine, single -> single_engine.py, fsdp ->
fsdp_engine.py, deepspeed -> deepspeed_engine.py and deepspeed_pipe.py, megatron -> megatron_engine.py.
"""

from __future__ import annotations

from harness import registry
from harness.registry import ModelRule, Rule

# Fields only one engine takes: every other engine refuses them (each lists them where its order of
# checks puts them).
ONLY_DEEPSPEED: list[Rule] = [
    ("ds_config", lambda lay: not lay.ds_config, "only for engine deepspeed"),
    ("model_impl", lambda lay: lay.model_impl == "own", "hf (transformers' LlamaForCausalLM) is for engine deepspeed"),
]
ONLY_OWN: list[Rule] = [
    ("pipeline_p2p", lambda lay: lay.pipeline_p2p == "auto",
     "chooses the own engine's pipeline transfers; engine {engine} has its own"),
]


def tied_across_stages(what: str, engine: str, takes) -> ModelRule:
    """An engine's refusal of tied embeddings split over pipeline stages: `what` says how it splits them."""
    return ("tie_word_embeddings", takes,
            f"{what}; splitting them needs the embedding gradient all-reduced between the first and the last "
            f"pipeline stage (Megatron's embedding group), which {engine} does not do here")


def gather_on_rank0(mine: dict | None) -> dict | None:
    """Merge every rank's {name: tensor} (None from ranks that own nothing) on global rank 0, for
    full_state_dict(); None elsewhere. Collective: every rank calls it."""
    import torch.distributed as dist

    everyone: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if everyone is None:
        return None
    out: dict = {}
    for part in everyone:
        out.update(part or {})
    return out


def build_engine(spec, shape, ctx):
    return registry.adapter(spec.layout.engine).build(spec, shape, ctx)
