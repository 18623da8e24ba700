"""What an engine's facts say it honours (harness.registry.EngineFacts.honours), in the schema's words.

A facts module names the values of a choice field it runs through these helpers, never by copying the
schema's tuple: honoured(prefix, ..., field=last) runs each named field's values `through` `last`, in the
schema's order (schema.through), and some(path, *values) a subset; each name is checked against the
schema's choices when the facts module is built, so a typo or a value the schema dropped fails at import.
The schema appends new values, past every engine's `through`: every engine refuses one until its facts move
their pin or name it (opt-in, with no second list of values). EVERY_ENGINE, FP8 and MOE are what several
engines declare alike.
"""

from __future__ import annotations

import dataclasses

from harness.registry import ANY, Honoured
from harness.spec.schema import Layout, Optimizer, Workload, subset, through

# Every field of the run spec by path ("layout.cp"), and the values of each choice field.
FIELDS = {
    f"{prefix}.{f.name}": f
    for prefix, cls in (("layout", Layout), ("workload", Workload))
    for f in dataclasses.fields(cls)
}
CHOICES: dict[str, tuple] = {
    path: tuple(f.metadata["choices"]) for path, f in FIELDS.items() if "choices" in f.metadata
}


def honoured(prefix: str, names: str = "", **last) -> dict[str, Honoured]:
    """The fields an engine honours of `prefix` ("layout" or "workload"): each of `names` (space-separated,
    fields that are not choices: sizes, degrees, flags) with any value, and each choice field given as
    `field=value` with its values through `value`."""
    out = {}
    for name in names.split():
        path = f"{prefix}.{name}"
        if path not in FIELDS or path in CHOICES:
            raise ValueError(
                f"{path}: not a field of the spec"
                if path not in FIELDS
                else f"{path}: a choice field, give {name}=<the last value run>"
            )
        out[path] = ANY
    for name, value in last.items():
        out[f"{prefix}.{name}"] = Honoured(through(_choices(f"{prefix}.{name}"), value))
    return out


def some(path: str, *values, why: str) -> Honoured:
    """Honoured with these of choice field `path`'s values only; `why` is the one-line reason for the others."""
    return Honoured(subset(_choices(path), *values), why)


def _choices(path: str) -> tuple:
    if path not in CHOICES:
        raise ValueError(f"{path}: not a choice field of the spec")
    return CHOICES[path]


# What every engine honours: the workload is the same for every engine (model, batch, steps, optimizer,
# the precision policy, data, device; where an engine cannot follow the policy, its precision_limits say
# so), and every engine splits the batch into micro-batches. A field added to the schema's Workload or
# Layout is in no engine's list until an engine declares it: until then, any value but its default is
# refused in one line.
EVERY_ENGINE: dict[str, Honoured] = {
    **honoured(
        "workload",
        "model model_overrides seq_len global_batch_size steps warmup_steps optimizer grad_clip seed data",
        precision="bf16",
        grad_accum_dtype="bf16",
        grad_reduce_dtype="bf16",
        device="cuda",
    ),
    "layout.engine": ANY,
    "layout.micro_batch_size": ANY,
}

# What an engine that runs FP8 (torchao, harness/model/float8.py) declares: the precision with fp8 and the recipe.
FP8: dict[str, Honoured] = honoured("workload", precision="fp8", fp8_recipe="rowwise")
# What an engine that also runs MXFP8 declares beside FP8 (harness/model/mxfp8.py): the recipes through mxfp8.
MXFP8: dict[str, Honoured] = honoured("workload", fp8_recipe="mxfp8")

# What an engine that runs mixture-of-experts models declares (with runs_moe): the router's two loss coefficients.
MOE: dict[str, Honoured] = honoured("workload", "moe_aux_loss_coeff moe_z_loss_coeff")

# workload.optimizer's choice fields, by path: every engine honours workload.optimizer (its numbers), and these
# apart (capabilities.honoured_error), opt-in as any choice: an engine that runs Muon declares MUON.
OPTIMIZER_CHOICES: dict[str, tuple] = {
    f"workload.optimizer.{f.name}": tuple(f.metadata["choices"])
    for f in dataclasses.fields(Optimizer)
    if "choices" in f.metadata
}
MUON: dict[str, Honoured] = {
    "workload.optimizer.name": Honoured(through(OPTIMIZER_CHOICES["workload.optimizer.name"], "muon")),
    "workload.optimizer.muon_adjust_lr": Honoured(
        through(OPTIMIZER_CHOICES["workload.optimizer.muon_adjust_lr"], "match_rms_adamw")
    ),
}

# What an engine that runs activation_checkpointing selective_op (torchtitan's per-op policy,
# harness/model/op_checkpoint.py) cannot combine it with: a capability and a precision limit, one text each.
SELECTIVE_OP_COMPILE = (
    "activation_checkpointing",
    lambda lay: lay.activation_checkpointing != "selective_op" or lay.compile == "none",
    "selective_op with compile blocks is not checked here (the per-op policy runs as a dispatch mode around "
    "eager blocks): set compile none",
)
SELECTIVE_OP_FP8 = (
    "precision",
    lambda w, lay: w.precision != "fp8" or lay.activation_checkpointing != "selective_op",
    "fp8 with selective_op: the per-op policy counts aten.mm and aten.addmm, and torchao's FP8 linears run "
    "other ops (harness/model/op_checkpoint.py): not checked here; use bf16 or another checkpointing mode",
)
