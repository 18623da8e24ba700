"""The mixture-of-experts feed-forward, one definition every engine shares: the router, its two losses
and the experts, plain and single-device (Mixtral's and Qwen3-MoE's block, dropless).

Routing (`route`) is in fp32 whatever the precision: the router's logits, a softmax over the experts,
the top experts_per_token of them, their weights renormalised to sum to 1 when the shape says so
(Mixtral always, Qwen3-MoE with norm_topk_prob), as transformers computes them. No token is dropped:
every expert runs on exactly the tokens routed to it, so the MoE layer is one function of its input
whatever the parallel layout, and every layout can be checked against this one.

The losses (`router_losses`) are defined here once, per forward (one micro-batch's tokens):
- the load-balancing loss of Switch/GShard in Megatron-core's normalisation, E/k · Σ_e f_e · P_e with
  f_e the share of the T·k routed slots that went to expert e and P_e the mean router probability of
  e: 1 when routing is uniform, whatever E and k (transformers' Mixtral loss is k times this);
- the router z-loss of ST-MoE, the mean of logsumexp(logits)² over tokens.
Their weighted sum enters the gradient the way Megatron-core's MoEAuxLossAutoScaler does it: an identity
on the layer's output whose backward adds d(aux)·scale, so no engine has to carry the losses to its
loss function (a pipeline stage's layers are not where the loss is). `scale` is 1 / micro-batches per
step, as the LM loss of each micro-batch is scaled: the aux term is then the mean over micro-batches,
and data parallelism's gradient mean makes it the mean over the global batch, as the reference's.

A layout that splits one micro-batch's tokens over ranks (sequence or context parallelism) must sum
the statistics (`RouterInputs`) over them before the losses: the losses are not additive over tokens.
Router statistics (tokens per expert, the losses' values) are kept per layer for the run's record
(`take_router_stats`), counted in forward only (not again in a checkpoint's recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.model.feed_forward import FeedForward  # the dense block's SwiGLU, one expert each
from harness.model.presets import Shape


def route(logits: torch.Tensor, k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32) -> (weights [T, k] fp32, experts [T, k] int64, probs [T, E] fp32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probs


@dataclass
class RouterInputs:
    """What the losses need of one forward's tokens, additive over tokens (so ranks holding parts of
    one micro-batch sum them): routed slots per expert, summed probabilities, summed squared
    logsumexp, and the token count."""

    counts: torch.Tensor  # [E] routed slots (float, no gradient)
    prob_sum: torch.Tensor  # [E] Σ_t probs[t, e]
    z_sum: torch.Tensor  # [] Σ_t logsumexp(logits[t])²
    tokens: int

    @classmethod
    def of(cls, logits: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor) -> RouterInputs:
        counts = torch.bincount(experts.reshape(-1), minlength=probs.shape[-1]).to(probs.dtype)
        z = torch.logsumexp(logits.float(), dim=-1)
        return cls(counts, probs.sum(dim=0), (z * z).sum(), logits.shape[0])


def router_losses(r: RouterInputs, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) of one forward's tokens, unweighted (see the module's docstring)."""
    experts = r.counts.shape[0]
    f = r.counts / (r.tokens * k)  # shares of the routed slots: sum to 1
    p = r.prob_sum / r.tokens  # mean router probabilities: sum to 1
    return experts * (f * p).sum(), r.z_sum / r.tokens


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; its backward also sends `scale` as the gradient of `aux`, so the aux loss
    reaches the router's weights without being added to the LM loss (Megatron-core's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output, aux, scale: float):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def _in_backward() -> bool:
    """Whether this forward is a checkpoint's recomputation, run inside autograd's backward."""
    return torch._C._current_graph_task_id() != -1


class RouterStats:
    """One layer's routing statistics since they were last taken: routed slots per expert, and the sum
    and count of its two losses (unweighted), forward passes only. Summed where they are computed (one
    device tensor: routed slots, then the two losses), read on the host only by take(), after the step:
    a forward never waits for the device."""

    def __init__(self, experts: int):
        self.experts = experts
        self.reset()

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None  # [experts + 2], float64, on the routing's device
        self.forwards = 0

    def take(self) -> dict:
        """The statistics since the last take (then reset): routed slots per expert (list), the mean
        load-balancing and z losses over the forwards, and the forward count."""
        n = max(self.forwards, 1)
        sums = [0.0] * (self.experts + 2) if self.sums is None else self.sums.tolist()
        out = {"counts": sums[: self.experts], "aux": sums[-2] / n, "z": sums[-1] / n, "forwards": self.forwards}
        self.reset()
        return out

    def add(self, counts: torch.Tensor, aux: torch.Tensor, z: torch.Tensor) -> None:
        if _in_backward():
            return
        row = torch.cat([t.detach().double().reshape(-1) for t in (counts, aux, z)])
        self.sums = row if self.sums is None else self.sums + row
        self.forwards += 1


def attach_router_losses(out: torch.Tensor, r: RouterInputs, layer) -> torch.Tensor:
    """The one place a layer's routing becomes statistics and a loss gradient: `layer` holds k, stats,
    aux_coeff, z_coeff and aux_scale (the harness's MoE block, or an engine's stand-in for its own layer);
    the statistics of `r` are recorded and the weighted losses' gradient attached to `out`."""
    aux, z = router_losses(r, layer.k)
    layer.stats.add(r.counts, aux, z)
    if (layer.aux_coeff or layer.z_coeff) and torch.is_grad_enabled():
        out = AuxLossScaler.apply(out, layer.aux_coeff * aux + layer.z_coeff * z, layer.aux_scale)
    return out


class MoEFeedForward(nn.Module):
    """The routed feed-forward: `router` (a bias-free linear, hidden -> experts) and the SwiGLU
    `experts`, keyed by their global index (an expert-parallel rank holds some of them under the same
    names). forward: x [..., hidden] -> [..., hidden]."""

    def __init__(self, shape: Shape, experts: range | None = None, ffn: int | None = None):
        super().__init__()
        held = range(shape.experts) if experts is None else experts
        self.k, self.normalise, self.n_experts = shape.experts_per_token, shape.norm_topk, shape.experts
        self.router = nn.Linear(shape.hidden, shape.experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(shape.hidden, ffn or shape.moe_ffn) for e in held})
        self.aux_coeff = self.z_coeff = 0.0  # the workload's coefficients (set_router_losses)
        self.aux_scale = 1.0  # 1 / micro-batches per step
        self.stats = RouterStats(shape.experts)

    def gate(self, x2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Route tokens x2 [T, hidden]: (weights [T, k] fp32, experts [T, k], probs [T, E], logits)."""
        logits = F.linear(x2.float(), self.router.weight.float())
        weights, experts, probs = route(logits, self.k, self.normalise)
        return weights, experts, probs, logits

    def attach_losses(self, out: torch.Tensor, r: RouterInputs) -> torch.Tensor:
        """Record the statistics of `r` (this forward's tokens, summed over the ranks holding them) and
        attach the weighted losses' gradient to `out`."""
        return attach_router_losses(out, r, self)

    def run_experts(self, x2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ_k weight · expert(x) per token, every held expert run on exactly its tokens (none: an empty
        batch, so its gradient is zeros, not missing, as in every engine's flat buffers)."""
        out = torch.zeros_like(x2)
        for key, expert in self.experts.items():
            token, slot = torch.nonzero(experts == int(key), as_tuple=True)
            y = expert(x2[token]) * weights[token, slot, None].to(x2.dtype)
            out = out.index_add(0, token, y)
        return out

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        weights, experts, probs, logits = self.gate(x2)
        out = self.run_experts(x2, weights, experts)
        return self.attach_losses(out, RouterInputs.of(logits, experts, probs)).view_as(x)


def moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """The MoE feed-forwards a model (or stage) holds, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoEFeedForward)}


def set_router_losses(model: nn.Module, aux_coeff: float, z_coeff: float, micro_batches: int) -> None:
    """Give every MoE layer the workload's loss coefficients and the per-micro-batch scale of their gradient."""
    for m in moe_layers(model).values():
        m.aux_coeff, m.z_coeff, m.aux_scale = aux_coeff, z_coeff, 1.0 / micro_batches


def take_router_stats(model: nn.Module) -> dict[str, dict]:
    """Each MoE layer's statistics since the last call (then reset): routed slots per expert (list),
    the mean load-balancing and z losses over its forwards, and the forward count."""
    return {name: m.stats.take() for name, m in moe_layers(model).items()}


def imbalance(counts) -> float:
    """Tokens per expert, max over mean (1: balanced; E/k at worst for top-k): the slowest expert's load
    relative to an even split, what an expert-parallel step waits for."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    mean = counts.mean()
    return float(counts.max() / mean) if mean > 0 else 1.0


def combine_router_stats(per_rank: list[dict]) -> dict:
    """One step's statistics of every rank (each {layer: take_router_stats' entry}) as the step's:
    routed slots summed over the ranks (each counts its own tokens once), the losses averaged over
    every forward that computed them."""
    out: dict[str, dict] = {}
    for stats in per_rank:
        for name, s in stats.items():
            o = out.setdefault(name, {"counts": [0.0] * len(s["counts"]), "aux": 0.0, "z": 0.0, "forwards": 0})
            o["counts"] = [a + b for a, b in zip(o["counts"], s["counts"], strict=True)]
            o["aux"] += s["aux"] * s["forwards"]
            o["z"] += s["z"] * s["forwards"]
            o["forwards"] += s["forwards"]
    for o in out.values():
        n = max(o["forwards"], 1)
        o["aux"], o["z"] = o["aux"] / n, o["z"] / n
    return out


def router_record(steps: list[dict], warmup: int) -> dict:
    """The record's `router` entry from every step's combined statistics (combine_router_stats): per
    step, the tokens-per-expert imbalance (max over mean, the worst layer's and the layers' mean) and
    the unweighted load-balancing and z losses (the layers' mean); per layer, the routed slots per
    expert summed over the measured steps."""
    layers = sorted(
        {name for step in steps for name in step}, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")]
    )
    if not layers:
        return {}

    def mean(values):
        return sum(values) / len(values) if values else None

    per_step = [[step[n] for n in layers if n in step] for step in steps]
    measured = steps[warmup:]
    return {
        "definition": (
            "imbalance: routed tokens per expert, max over mean (1 = balanced); aux: load-balancing loss "
            "E/k·Σ f_e·P_e (1 = uniform routing); z: mean logsumexp(router logits)²; both unweighted, per micro-batch"
        ),
        "layers": layers,
        "imbalance_max": [max((imbalance(s["counts"]) for s in step), default=None) for step in per_step],
        "imbalance_mean": [mean([imbalance(s["counts"]) for s in step]) for step in per_step],
        "aux_loss": [mean([s["aux"] for s in step]) for step in per_step],
        "z_loss": [mean([s["z"] for s in step]) for step in per_step],
        "tokens_per_expert": {
            n: [sum(v) for v in zip(*(step[n]["counts"] for step in measured if n in step), strict=True)]
            for n in layers
            if any(n in step for step in measured)
        },
    }
