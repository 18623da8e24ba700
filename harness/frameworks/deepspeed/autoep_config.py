"""The ds_config's expert_parallel section when layout.ds_moe is autoep: DeepSpeed AutoEP (deepspeed/
module_inject/auto_ep*.py) told what the harness's MoE block is and how it routes, so that the layer it
builds in its place is the reference's. Pure (no torch, no DeepSpeed import), like config.py, which calls it.

AutoEP finds a model's MoE blocks by a custom pattern (its config keys, deepspeed/module_inject/
auto_ep_presets/registry.py, _build_custom_preset): blocks named by moe_layer_pattern, with a `router`
linear and `experts`, each expert an nn.Module with Linear children w1 (gate), w3 (up) and w2 (down) of
SwiGLU w2(silu(w1 x) * w3 x): the harness's FeedForward (deepspeed/autoep.py hands AutoEP the experts as
an nn.ModuleList, the form it reads). Its TokenChoiceTopKRouter (deepspeed/moe/ep_router.py) then routes
as harness.model.moe.route does when (all owned here, an explicit other value refused):
  score_func softmax       softmax over the experts in fp32 (the reference's probabilities),
  top_k                    = experts_per_token: the top k of the probabilities (topk, unsorted: the same set),
  route_norm               = norm_topk: the k weights over their sum (+1e-20, below an fp32 ulp of a sum
                             of top-k probabilities, which is at least k/E),
  route_scale 1.0          (routed_scaling_factor the same),
  score_apply post         the weight times the expert's output (pre would weight its input: SwiGLU is
                           not linear),
and no group-limited routing (num_expert_groups), shared experts or preset_model (the harness's model is
not a transformers one). The gate's logits are those of its Linear in the parameters' dtype, which is
the reference's fp32 router only under fp32 (deepspeed/facts.py refuses bf16 and fp8 with AutoEP).
use_grouped_mm is the file's (DeepSpeed's default true: torch._grouped_mm, which runs on this CPU in fp32 too,
its SwiGLU falling back to eager without Triton).
Dropless: AutoEP's all-to-all sends every routed slot (variable splits), there is no capacity.
"""

from __future__ import annotations

# The harness model's MoE blocks (harness/model/llama.py: layers.<i>.feed_forward, MoEFeedForward).
PATTERN = {
    "moe_layer_pattern": r"layers\.\d+\.feed_forward",
    "router_pattern": "router",
    "expert_pattern": "experts",
    "expert_w1": "w1",
    "expert_w2": "w2",
    "expert_w3": "w3",
    "expert_activation": "swiglu",
}
# Keys whose DeepSpeed default is what the reference does and any other value is not: absent, null or these.
ABSENT = {
    "preset_model": None,
    "num_expert_groups": None,
    "num_limited_groups": None,
    "has_shared_experts": False,
    "expert_tensor_parallel_size": 1,
}
SECTION = "expert_parallel"


def fill_expert_parallel(f, cfg: dict, lay, shape) -> None:
    """Fill or check the expert_parallel section (f: config._Filler; shape: the model's)."""
    section = cfg.get(SECTION)
    if section is not None and not isinstance(section, dict):
        f.fatal(SECTION, "must be a JSON object")
    if lay.ds_moe != "autoep":
        if section and section.get("enabled", False) not in (False, "auto"):
            f.refuse(f"{SECTION}.enabled", "layout.ds_moe decides it: set ds_moe: autoep to run DeepSpeed AutoEP")
        elif section and section.get("enabled") == "auto":
            section["enabled"] = False
            f.filled.append(f"{SECTION}.enabled")
        return
    k = f"{SECTION}."
    f.own(k + "enabled", True, "layout.ds_moe (autoep)")
    f.own(k + "autoep_size", lay.ep, "layout.ep")
    f.own(k + "top_k", shape.experts_per_token, "model's experts_per_token")
    f.own(k + "score_func", "softmax", "router (softmax over the experts)")
    f.own(k + "route_norm", bool(shape.norm_topk), "model's norm_topk")
    f.own(k + "route_scale", 1.0, "router (weights unscaled)")
    f.own(k + "routed_scaling_factor", 1.0, "router (weights unscaled)", required=False)
    f.own(k + "score_apply", "post", "MoE block (the weight times the expert's output)")
    for key, value in PATTERN.items():
        f.own(k + key, value, "harness MoE block's structure")
    ep = cfg[SECTION]
    for key, default in ABSENT.items():
        if ep.get(key, default) not in (default, None):
            f.refuse(k + key, f"{ep[key]!r}: the harness's MoE block has none of it; remove the key")
