"""`harness plan`'s flags for the memory settings published recipes name (PlannerLayout's recipe fields,
harness/planner/memory_recipes.py models each): set on every candidate layout, each refused in one line where
the engine planned does not have the setting, no candidate would use it or an export would drop it, so that none
is silently ignored.

Megatron's (--engine megatron): recompute_num_layers, cpu_offloading_num_layers, fp8_param_gather,
grad_reduce_in_fp32, bias_activation_fusion, cross_entropy_loss_fusion, expert_tensor_parallel_size,
moe_router_force_load_balancing, overlap_moe_expert_parallel_comm and Transformer Engine's attention;
torch.distributed.pipelining's kept outputs (--engine fsdp, as torchtitan ran it before passing
return_outputs=False) and, with them, the allocator's expandable segments. torchtitan's per-op policy is
--activation-checkpointing selective_op.
"""

from __future__ import annotations

from harness.errors import SpecError

MEGATRON = "megatron"
# flag -> (PlannerLayout field, the engine whose setting it is, help)
_SWITCHES = {
    "--fp8-params": ("fp8_params", MEGATRON, "fp8 primary weights, no bf16 copy (fp8_param_gather; with fp8)"),
    "--fused-swiglu": ("fused_swiglu", MEGATRON, "SwiGLU fused, saving its input only (bias_activation_fusion)"),
    "--loss-fusion": ("loss_fusion", MEGATRON, "cross-entropy fused, in the logits' dtype (cross_entropy_loss_fusion)"),
    "--te-attention": ("te_attention", MEGATRON, "Transformer Engine's attention: grouped k and v kept as they are"),
    "--moe-balanced": ("moe_balanced", MEGATRON, "MoE: every expert the same tokens (moe_router_force_load_balancing)"),
    "--moe-a2a-overlap": (
        "moe_a2a_overlap",
        MEGATRON,
        "MoE: overlap_moe_expert_parallel_comm's extra interleaved warm-up micro-batch (its hidden all-to-all is not "
        "in the time model)",
    ),
    "--pp-outputs-kept": (
        "pp_outputs_kept",
        "fsdp",
        "the last pipeline stage keeps every micro-batch's logits to the step's end (torch.distributed.pipelining's "
        "step() without return_outputs=False, as torchtitan ran until 2025-10)",
    ),
    "--expandable-segments": (
        "expandable_segments",
        "fsdp",
        "with --pp-outputs-kept: PyTorch's allocator under expandable_segments:True, whose growing segment the "
        "pipeline's merged outputs reuse (no segment of their own: harness/planner/memory_reserve.py)",
    ),
}


def add_recipe_arguments(p) -> None:
    p.add_argument(
        "--recompute-layers",
        type=int,
        help="megatron, with full checkpointing: layers of each pipeline chunk recomputed, the others keep all "
        "(recompute_method block, recompute_num_layers)",
    )
    p.add_argument(
        "--offload-layers",
        type=int,
        help="megatron: layers whose saved activations wait in host memory (cpu_offloading_num_layers)",
    )
    p.add_argument(
        "--main-grads",
        choices=("fp32", "bf16"),
        help="megatron: the main-gradient buffer's dtype (bf16: grad_reduce_in_fp32 false; default fp32)",
    )
    p.add_argument(
        "--expert-tp",
        type=int,
        help="megatron, MoE: expert_tensor_parallel_size; 1: experts whole, the tp ranks holding different ones "
        "(parallel folding: Megatron's ep is then --ep x tp)",
    )
    for flag, (_, engine, text) in _SWITCHES.items():
        p.add_argument(flag, action="store_true", help=f"{engine}: {text}")


def recipe_fields(args, shape, checkpointing, precisions) -> dict:
    """The PlannerLayout fields the recipe flags set (none: {}), each checked against the engine planned, the
    checkpointing and precisions asked for, and the model."""
    fields: dict = {}
    for flag, (name, engine, _) in _SWITCHES.items():
        if getattr(args, name, False):
            _engine(args, flag, engine)
            fields[name] = True
    for name in ("moe_balanced", "moe_a2a_overlap"):
        if fields.get(name) and not shape.moe:
            raise SpecError("--" + name.replace("_", "-"), f"{args.model} has no experts")
    if fields.get("expandable_segments") and not fields.get("pp_outputs_kept"):
        raise SpecError(
            "--expandable-segments", "the planner's memory reads it for the merged outputs of --pp-outputs-kept"
        )
    if fields.get("fp8_params") and "fp8" not in precisions:
        raise SpecError("--fp8-params", "fp8 primary weights need --precision fp8")
    for flag, name, low in (("--recompute-layers", "recompute_layers", 1), ("--offload-layers", "offload_layers", 1)):
        value = getattr(args, name, None)
        if value is None:
            continue
        _engine(args, flag, MEGATRON)
        if not low <= value <= shape.layers:
            raise SpecError(flag, f"{value}: takes 1 to the model's {shape.layers} layers")
        fields[name] = value
    if "recompute_layers" in fields and "full" not in checkpointing:
        raise SpecError("--recompute-layers", "recomputes under full checkpointing: --activation-checkpointing full")
    if getattr(args, "main_grads", None) is not None:
        _engine(args, "--main-grads", MEGATRON)
        fields["main_grads"] = args.main_grads
    if getattr(args, "expert_tp", None) is not None:
        _engine(args, "--expert-tp", MEGATRON)
        if not shape.moe:
            raise SpecError("--expert-tp", f"{args.model} has no experts")
        if args.expert_tp not in (0, 1):
            raise SpecError("--expert-tp", f"{args.expert_tp}: the planner models 1 (experts whole) or 0 (the tp's)")
        fields["expert_tp"] = args.expert_tp
    for flag in ("--export", "--emit-sweep"):
        if fields and getattr(args, flag[2:].replace("-", "_"), None):
            names = ", ".join(sorted(fields))
            raise SpecError(flag, f"the recipe settings ({names}) are planned, not written to its file")
    return fields


def _engine(args, flag: str, engine: str) -> None:
    if args.engine != engine:
        raise SpecError(flag, f"a setting of engine {engine}, not of {args.engine} (--engine {engine})")
