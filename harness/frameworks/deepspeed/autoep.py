"""Engine deepspeed's mixture of experts through DeepSpeed AutoEP (layout.ds_moe autoep): deepspeed.initialize
replaces each MoE block with its AutoEPMoELayer (deepspeed/module_inject/auto_ep_layer.py: TokenChoiceTopKRouter,
the routed slots exchanged by all_to_all_single with variable splits over the expert-parallel group, this
rank's E/ep experts as GroupedExperts), found through the expert_parallel section autoep_config.py writes.

The block AutoEP reads (AutoEPSource) is the reference's: the harness model is built and loaded with the
reference weights as every engine's, then each MoEFeedForward is handed over as its router Linear and its
experts as an nn.ModuleList in global order (AutoEP's module_list storage; the model's own ModuleDict keyed by
global index is what every other engine's names and checkpoints rest on, so it is not changed). AutoEP copies
the router's weight and stacks this rank's experts' w1, w2, w3 into [E/ep, ...] tensors (ep_repack.py), so
no rank loads another's experts' values from anywhere but the same reference weights.

AutoEP's router has no auxiliary loss (load_balance_coeff is refused by 0.19.8) and no z-loss: the harness's
losses and statistics (harness.model.moe) are taken as for DeepSpeed's MoE layer (experts.py): a forward hook
on the router takes its input and its selected experts, recomputes the logits from gate.weight in fp32 (so
the aux gradient reaches the gate) and the layer's output carries the weighted losses' gradient through
AuxLossScaler, scale 1 / gradient_accumulation_steps; statistics are counted in forward only.

Names: layers.<i>.feed_forward.router.gate.weight is the reference's layers.<i>.feed_forward.router.weight;
...feed_forward.experts.w<n> ([E/ep, out, in]) on expert-parallel rank r holds experts.<r * E / ep + j>.w<n>.weight
at row j (AutoEP's uniform placement, ep_repack._local_expert_range; its expert-parallel groups are consecutive
ranks, as DeepSpeed's MoE layer's).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.model.moe import RouterInputs, RouterStats, attach_router_losses, moe_layers

_GATE = re.compile(r"^(.*\.feed_forward)\.router\.gate\.weight$")
_EXPERTS = re.compile(r"^(.*\.feed_forward)\.experts\.(w[123])$")

SETTINGS = (
    "DeepSpeed AutoEP (AutoEPMoELayer: TokenChoiceTopKRouter softmax top-k, all_to_all_single with variable "
    "splits, dropless, GroupedExperts), custom pattern for the harness's MoE block"
)
LOSSES = (
    "the harness's load-balancing and z losses (harness.model.moe.router_losses) on the router's fp32 logits, "
    "through AuxLossScaler on the layer's output; AutoEP has neither"
)


class AutoEPSource(nn.Module):
    """One harness MoE block as AutoEP reads it: `router` (the block's Linear) and `experts` (its FeedForwards
    in global order, an nn.ModuleList). AutoEP replaces it inside deepspeed.initialize; it never runs."""

    def __init__(self, moe):
        super().__init__()
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[str(e)] for e in range(moe.n_experts))

    def forward(self, x):
        raise RuntimeError("DeepSpeed AutoEP did not replace this MoE block: check the expert_parallel section")


def hand_over(model) -> None:
    """Each block's MoEFeedForward (built and loaded as the reference's) as AutoEPSource."""
    for block in model.layers.values():
        block.feed_forward = AutoEPSource(block.feed_forward)


class RouterTap:
    """The harness's router losses and statistics on one AutoEPMoELayer (hooks on its router and output)."""

    def __init__(self, layer, aux: float, z: float, micro_batches: int):
        self.k, self.n_experts = layer.top_k, layer.num_experts
        self.aux_coeff, self.z_coeff, self.aux_scale = aux, z, 1.0 / micro_batches
        self.stats = RouterStats(layer.num_experts)
        self._pending: RouterInputs | None = None
        layer.router.register_forward_hook(self._route)
        layer.register_forward_hook(self._attach)

    def _route(self, router, args, output) -> None:
        """The router's input x [T, hidden] and its selected experts [T, k] (output[1])."""
        logits = F.linear(args[0].float(), router.gate.weight.float())
        self._pending = RouterInputs.of(logits, output[1], torch.softmax(logits, dim=-1))

    def _attach(self, layer, args, out):
        r, self._pending = self._pending, None
        return attach_router_losses(out, r, self)


def tap(model, aux: float, z: float, micro_batches: int) -> dict[str, RouterTap]:
    """Hooks on every AutoEPMoELayer of the model deepspeed.initialize returned, by module name."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    assert not moe_layers(model)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)}
    if not layers:
        raise RuntimeError("DeepSpeed AutoEP replaced no MoE block")
    from harness.frameworks.deepspeed.experts import expert_groups

    declared = expert_groups()["ep"]  # the profiler's ep axis (process_groups): AutoEP's all-to-alls run on these
    assert all(any(m.ep_group is g for g in declared) for m in layers.values() if m.ep_size > 1)
    return {name: RouterTap(m, aux, z, micro_batches) for name, m in layers.items()}


def take_stats(taps: dict[str, RouterTap]) -> dict:
    """take_router_stats' format."""
    return {name: t.stats.take() for name, t in taps.items()}


def is_expert(name: str) -> bool:
    return _EXPERTS.match(name) is not None


def plain_entries(name: str, tensor: torch.Tensor, shape, ep: int, ep_rank: int) -> list[tuple[str, torch.Tensor]]:
    """The reference's names and tensors of an AutoEP parameter on expert-parallel rank ep_rank (others as they are)."""
    m = _GATE.match(name)
    if m:
        return [(f"{m.group(1)}.router.weight", tensor)]
    m = _EXPERTS.match(name)
    if m:
        first = ep_rank * (shape.experts // ep)
        return [(f"{m.group(1)}.experts.{first + j}.{m.group(2)}.weight", t.clone()) for j, t in enumerate(tensor)]
    return [(name, tensor)]
