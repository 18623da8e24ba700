"""Engine deepspeed's mixture of experts: DeepSpeed's own MoE layer (deepspeed.moe.layer.MoE: TopKGate, MOELayer
with its all-to-all over the expert-parallel group, Experts) in each block, in place of the plain model's
harness.model.moe.MoEFeedForward, with the harness's expert (harness.model.feed_forward.FeedForward at moe_ffn).

Configured to be the reference's layer (checked by tests/test_deepspeed_moe.py):
  - routing: TopKGate computes the router logits in fp32 (F.linear with wg.weight, hidden -> experts: the
    reference's router.weight), a softmax, top-1 by argmax; top-2 takes the second by argmax of the logits
    without the first, top2_2nd_expert_sampling=False (DeepSpeed's default adds Gumbel noise to draw it),
    and renormalises the two weights (the reference's norm_topk True); top-1 keeps the softmax weight
    (norm_topk False). Other k, or k with the other normalisation, are refused (deepspeed/facts.py);
  - dropless: drop_tokens=False sets each expert's capacity to the largest count over the expert-parallel
    group, use_rts=False, no noisy gate, no residual MoE; each forward checks that no route was evicted;
  - the losses are the harness's (router_losses), not DeepSpeed's l_aux (top-1 choices only, returned and
    never added to the loss by DeepSpeed): a forward hook on the gate takes its input and the routes it
    dispatched (the slots per expert), recomputes the logits from wg.weight (the same fp32 F.linear, so
    the aux gradient reaches wg) and the layer's output carries the weighted losses' gradient through
    harness.model.moe.AuxLossScaler, scale 1 / gradient_accumulation_steps (DeepSpeed divides the LM loss
    by it in backward); DeepSpeed's data-parallel gradient mean then makes it the global batch's mean.

Names: layers.<i>.feed_forward.deepspeed_moe.gate.wg.weight is the reference's
layers.<i>.feed_forward.router.weight; ...deepspeed_moe.experts.deepspeed_experts.<j>.w<n>.weight on
expert-parallel rank r is experts.<r * E / ep + j>.w<n>.weight (DeepSpeed's expert-parallel groups are
consecutive ranks: deepspeed/utils/groups.py, _create_expert_and_data_parallel).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from deepspeed.moe.layer import MoE

from harness.model.moe import RouterInputs, RouterStats, attach_router_losses, moe_layers

_GATE = re.compile(r"^(.*\.feed_forward)\.deepspeed_moe\.gate\.wg\.weight$")
_EXPERT = re.compile(r"^(.*\.feed_forward)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)$")

SETTINGS = (
    "deepspeed.moe.layer.MoE, dropless (drop_tokens=False), use_rts=False, noisy_gate_policy None, "
    "top2_2nd_expert_sampling=False (no Gumbel-sampled second expert), use_residual=False"
)
LOSSES = (
    "the harness's load-balancing and z losses (harness.model.moe.router_losses) on the gate's logits, "
    "through AuxLossScaler on the layer's output; DeepSpeed's l_aux (top-1 only) is not used"
)


class HarnessMoE(MoE):
    """DeepSpeed's MoE layer returning only its output (the plain Block's feed_forward), with the harness's
    router losses and statistics."""

    def __init__(self, shape, ep: int):
        from harness.model.feed_forward import FeedForward

        super().__init__(
            shape.hidden,
            FeedForward(shape.hidden, shape.moe_ffn),
            num_experts=shape.experts,
            ep_size=ep,
            k=shape.experts_per_token,
            capacity_factor=1.0,
            min_capacity=0,
            use_residual=False,
            noisy_gate_policy=None,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        self.k, self.n_experts = shape.experts_per_token, shape.experts
        self.aux_coeff = self.z_coeff = 0.0
        self.aux_scale = 1.0
        self.stats = RouterStats(shape.experts)
        self._pending: RouterInputs | None = None
        self.deepspeed_moe.gate.register_forward_hook(self._tap)

    def _tap(self, gate, args, output) -> None:
        """The gate's input (tokens [T, hidden]) and the routes it dispatched (indices [k, T], -1: evicted)."""
        x2, indices = args[0], output[3]
        if bool((indices < 0).any()):
            raise RuntimeError("DeepSpeed's MoE gate dropped a token although drop_tokens=False")
        logits = F.linear(x2.float(), gate.wg.weight.float())
        probs = torch.softmax(logits, dim=-1)
        counts = torch.bincount(indices.reshape(-1).long(), minlength=self.n_experts).to(probs.dtype)
        z = torch.logsumexp(logits, dim=-1)
        self._pending = RouterInputs(counts, probs.sum(dim=0), (z * z).sum(), logits.shape[0])

    def forward(self, x):
        out, _, _ = super().forward(x)
        r, self._pending = self._pending, None
        return attach_router_losses(out, r, self)


def swap_in(model, shape, ep: int) -> None:
    """Each block's MoEFeedForward replaced by DeepSpeed's layer (built where the model is: meta)."""
    for block in model.layers.values():
        block.feed_forward = HarnessMoE(shape, ep)


def deepspeed_layers(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, HarnessMoE)}


def set_losses(model, aux: float, z: float, micro_batches: int) -> None:
    for m in deepspeed_layers(model).values():
        m.aux_coeff, m.z_coeff, m.aux_scale = aux, z, 1.0 / micro_batches


def take_stats(model) -> dict:
    """take_router_stats' format for DeepSpeed's layers (moe_layers finds none of the plain ones left)."""
    assert not moe_layers(model)
    return {name: m.stats.take() for name, m in deepspeed_layers(model).items()}


def plain_name(name: str, shape, ep: int, ep_rank: int) -> str:
    """The reference's name of a DeepSpeed MoE parameter on expert-parallel rank ep_rank (others unchanged)."""
    m = _GATE.match(name)
    if m:
        return f"{m.group(1)}.router.weight"
    m = _EXPERT.match(name)
    if m:
        return f"{m.group(1)}.experts.{ep_rank * (shape.experts // ep) + int(m.group(2))}.{m.group(3)}"
    return name


def is_expert(name: str) -> bool:
    return _EXPERT.match(name) is not None


class Renamed:
    """The reference weights under DeepSpeed's names (load_reference asks only [name])."""

    def __init__(self, reference, shape, ep: int, ep_rank: int):
        self.reference, self.shape, self.ep, self.ep_rank = reference, shape, ep, ep_rank

    def __getitem__(self, name: str):
        return self.reference[plain_name(name, self.shape, self.ep, self.ep_rank)]


def optimizer_groups(model) -> list[dict]:
    """DeepSpeed's MoE parameter groups (expert parameters apart, reduced over the expert-data-parallel group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "params"})


def expert_groups() -> dict:
    """DeepSpeed's expert-parallel groups (no group_desc), for the profiler's axis names (its MoE layer's and
    AutoEP's: the same groups module), and its expert-data-parallel groups, counted as dp as the own engine's
    edp groups are (a one-rank group at dp = ep: ZeRO-3 still reduce-scatters the experts' gradients on it)."""
    from deepspeed.utils import groups

    return {
        "ep": list(groups._get_expert_parallel_group_dict().values()),
        "dp": list(groups._get_expert_data_parallel_group_dict().values()),
    }
