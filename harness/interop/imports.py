"""`harness import`: a user's Megatron-LM arguments, torchtitan recipe or ds_config as a harness run spec.

Each reader (megatron_in, torchtitan_in, deepspeed_in) gives the workload and layout that run the same
layout and optimizer here, and one line per field the harness cannot carry, with why; import_*()
returns (raw spec, not carried): the spec as harness.spec reads it. Bad input raises SpecError naming
the field. The formats are those harness/interop/exports.py writes (for the versions it names); a
user's own file may say more, which is listed, never guessed. The torchtitan recipe is read as text
(ast), never run. Nothing here imports torch.
"""

from __future__ import annotations

from harness.errors import SpecError
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


# What engine megatron here lacks that Megatron-LM runs (Transformer Engine: its attention backends,
# fused RMSNorm, context parallelism, FP8), replaced to check the rest of a Megatron-LM layout here.
WITHOUT_TE = {"attention": "naive", "rmsnorm": "torch"}


def _spec(engine: str, workload: dict, layout: dict, lost: list[str]) -> tuple[dict, list[str]]:
    """The raw spec, checked by harness.spec: for the harness's engine of that name when it runs the
    layout, else for the own engine (the harness's Megatron-style engine); each with the layout's
    attention kernel, else sdpa (which picks its flash kernel where one runs). Megatron-LM's layout stays
    engine megatron's where only Transformer Engine, absent here, stands between them (checked without
    it). What changed is said in `lost`."""
    if engine == "megatron":
        return _megatron_spec(workload, layout, lost)
    own = {**layout, "zero_stage": min(layout.get("zero_stage", 3), 1)}  # full sharding: ZeRO-1 at most
    own.pop("reshard_after_forward", None)
    tries = [(engine, layout), ("own", own)]
    first, why = None, {}
    for name, lay in tries:
        for attention in dict.fromkeys((lay.get("attention", "sdpa"), "sdpa")):
            raw = {"workload": workload, "layout": {"engine": name, **lay, "attention": attention}}
            try:
                parse_spec(raw)
            except SpecError as e:
                first, why[name] = first or e, e
                continue
            if name != engine:
                lost.append(
                    f"layout.engine: not carried: engine {engine} here refuses it ({why[engine]}); "
                    "written for engine own"
                )
            if attention != lay.get("attention", "sdpa"):
                lost.append(f"layout.attention: not carried: {lay['attention']} is refused here; written as sdpa")
            return raw, lost
    raise first


def _megatron_spec(workload: dict, layout: dict, lost: list[str]) -> tuple[dict, list[str]]:
    raw = {"workload": workload, "layout": {"engine": "megatron", **layout}}
    try:
        parse_spec(raw)
        return raw, lost
    except SpecError as e:
        here = e
    probe = {**layout, **WITHOUT_TE, "cp": 1, "dp": layout["dp"] * layout.get("cp", 1)}
    probe.pop("cp_impl", None)
    wl = {**workload, "precision": "bf16"} if workload.get("precision") == "fp8" else workload
    wl.pop("fp8_recipe", None) if wl is not workload else None
    parse_spec({"workload": wl, "layout": {"engine": "megatron", **probe}})  # a real blocker: one line
    lost.append(
        f"layout.engine: megatron kept: `harness train` here refuses it ({here.field}: engine megatron builds "
        "Megatron-core without Transformer Engine); the spec holds the layout Megatron-LM runs"
    )
    return raw, lost
