"""`harness import`: a user's Megatron-LM arguments, torchtitan recipe or ds_config as a harness run spec.

Each reader (megatron_in, torchtitan_in, deepspeed_in) gives the workload and layout that run the same
layout and optimizer here, and one line per field the harness cannot carry, with why; import_*()
returns (raw spec, not carried): the spec as harness.spec reads it. Bad input raises SpecError naming
the field. The formats are those harness/interop/exports.py writes (for the versions it names); a
user's own file may say more, which is listed, never guessed. The torchtitan recipe is read as text
(ast), never run. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses

from harness.errors import CapabilityError
from harness.interop.deepspeed_in import read_deepspeed
from harness.interop.megatron_in import read_megatron
from harness.interop.torchtitan_in import read_torchtitan
from harness.spec import parse_spec

IMPORT_FORMATS = ("megatron", "torchtitan", "deepspeed")


def import_megatron(text: str, gpus: int | None = None) -> tuple[dict, list[str]]:
    """A spec from Megatron-LM's pretrain_gpt.py arguments."""
    return _spec("megatron", *read_megatron(text, gpus))


def import_deepspeed(
    text: str, model: str | None, seq_len: int | None, gpus: int | None = None
) -> tuple[dict, list[str]]:
    """A spec from a ds_config; the model and sequence length, which a ds_config does not hold, from
    the arguments; the world size from --gpus where given."""
    return _spec("deepspeed", *read_deepspeed(text, model, seq_len, gpus))


def import_torchtitan(text: str, gpus: int | None = None, recipe: str | None = None) -> tuple[dict, list[str]]:
    """A spec from a torchtitan recipe: the file's function named `recipe` (needed where it has several)."""
    return _spec("fsdp", *read_torchtitan(text, gpus, recipe))


def _spec(engine: str, workload: dict, layout: dict, lost: list[str]) -> tuple[dict, list[str]]:
    """The raw spec for the harness's engine of the tool's name, checked by harness.spec. Where that
    engine cannot train the layout on this machine (Transformer Engine absent, a kernel or degree not
    built here: a CapabilityError), the spec still holds the tool's layout and engine, checked by the
    planner for a layout that can exist, and one line says why `harness train` here refuses it."""
    raw = {"workload": workload, "layout": {"engine": engine, **layout}}
    try:
        parse_spec(raw)
        return raw, lost
    except CapabilityError as e:
        here = e
    _coherent(engine, workload, layout)
    lost.append(f"layout.engine: {engine} kept; `harness train` on this machine refuses it ({here})")
    return raw, lost


def _coherent(engine: str, workload: dict, layout: dict) -> None:
    """SpecError where the layout cannot exist for the model and workload (the planner's check)."""
    from harness.model.presets import resolve_shape
    from harness.planner.layout import PlannerLayout, Workload, planner_engines
    from harness.planner.predict import validate

    shape = resolve_shape(workload["model"], workload.get("model_overrides"))
    lay = PlannerLayout.from_spec({**layout, "engine": engine}, workload.get("precision", "fp32"))
    if engine in planner_engines():
        lay = dataclasses.replace(lay, engine=engine)
    dtype_bytes = 4 if workload.get("precision", "fp32") == "fp32" else 2
    validate(shape, lay, Workload(workload["seq_len"], workload["global_batch_size"], dtype_bytes))
