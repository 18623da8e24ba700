"""`harness plan --export`: the chosen layout as a launch configuration of a named version of a tool.

- deepspeed_out: a complete ds_config for DeepSpeed (batch, bf16, AdamW, clipping, ZeRO).
- megatron_out: Megatron-LM's pretrain_gpt.py arguments at a named commit (layout, model shape, AdamW,
  constant LR, overlap, attention backend).
- torchtitan_out: a torchtitan recipe (a Python function returning Trainer.Config, the config system
  that replaced the TOML files) for a named release.

exportable() says why a target cannot run a layout; a layout it refuses is never exported. Each
exporter returns (text, notes): the notes say what the target does differently from the prediction.
The optimizer is harness.spec's (the workload's AdamW and gradient clipping; constant LR, as the
harness trains). Nothing here imports torch.
"""

from __future__ import annotations

from harness.interop import deepspeed_out, megatron_out, torchtitan_out
from harness.model.presets import Shape
from harness.planner.layout import PlannerLayout

EXPORT_FORMATS = ("deepspeed", "megatron", "torchtitan")
VERSIONS = {"deepspeed": deepspeed_out.VERSION, "megatron": megatron_out.VERSION, "torchtitan": torchtitan_out.VERSION}
# Each target's cp implementations, by its own name for them.
CP_COMM = {"megatron": megatron_out.CP_COMM, "torchtitan": torchtitan_out.CP_COMM, "deepspeed": deepspeed_out.CP_COMM}
EXPORTERS = {
    "deepspeed": deepspeed_out.export_deepspeed,
    "megatron": megatron_out.export_megatron,
    "torchtitan": torchtitan_out.export_torchtitan,
}


def exportable(lay: PlannerLayout, fmt: str, shape: Shape | None = None) -> str:
    """Empty when `fmt` runs the layout (and, given, the model's shape), else why not."""
    if fmt == "torchtitan" and shape is not None and torchtitan_out.torchtitan_flavor(shape) is None:
        return (  # the model first: no layout of it is theirs
            f"torchtitan's llama3 has no flavor of this shape (it has {', '.join(torchtitan_out.FLAVORS)})"
            if not shape.moe
            else torchtitan_out.torchtitan_refuses(shape, lay)
        )
    if lay.cp > 1 and lay.cp_impl not in CP_COMM[fmt]:
        return f"{fmt} has no {lay.cp_impl} context parallelism (it runs {', '.join(CP_COMM[fmt])})"
    if lay.shard_group < lay.replicas and (fmt != "torchtitan" or lay.shard_group % lay.cp):
        # torchtitan's FSDP mesh is data_parallel_shard_degree x cp: a group of whole cp groups
        return f"{fmt} has no sharding group of {lay.shard_group} of the dp x cp = {lay.replicas} ranks (HSDP)"
    if lay.precision == "fp8" and fmt == "deepspeed":  # Megatron-LM: --fp8-*; torchtitan: Float8LinearConverter
        return (
            f"{fmt}: FP8 is not a setting this export writes (DeepSpeed's config has none: torchao converts "
            "the model before deepspeed.initialize)"
        )
    if fmt == "deepspeed":  # what the harness's engine deepspeed runs (its facts)
        return deepspeed_out.deepspeed_refuses(lay)
    if fmt == "megatron":
        return megatron_out.megatron_refuses(shape, lay)
    if fmt == "torchtitan":
        return torchtitan_out.torchtitan_refuses(shape, lay)
    return ""
