"""Engine megatron's router statistics in the harness's format (harness.model.moe.take_router_stats), read off
Megatron's own TopKRouters.

A forward hook on each MoE layer's router records, per forward (one micro-batch's tokens on this rank), what
harness.model.moe.RouterInputs holds: the routed slots per expert from Megatron's routing_map (what its
dispatcher sent), and the summed softmax probabilities and squared logsumexp of the router's logits (the
logits recomputed from the hook's input in fp32, as moe_router_dtype fp32 computes them). A checkpoint's
recomputation in backward is not counted. After the step the tp ranks sum their rows (MoE under tp runs
with sequence parallelism: each tp rank routes its part of the sequence), and the losses of each forward
come from harness.model.moe.router_losses over the whole micro-batch; tp rank 0 reports them, the other tp
ranks nothing, so every routed token is counted once when the runner sums the ranks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.measure.ranges import harness_sync
from harness.model.moe import RouterInputs, RouterStats, _in_backward, router_losses


class RouterTaps:
    def __init__(self, gpts: list, shape, tp_group):
        self.k, self.experts = shape.experts_per_token, shape.experts
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if shape.moe else 1
        self.report = not shape.moe or dist.get_rank(tp_group) == 0
        self.pending: dict[str, list[torch.Tensor]] = {}
        self.stats: dict[str, RouterStats] = {}
        for gpt in gpts:
            for layer in gpt.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is None:
                    continue
                name = f"layers.{layer.layer_number - 1}.feed_forward"  # the reference's module name
                self.pending[name], self.stats[name] = [], RouterStats(shape.experts)
                router.register_forward_hook(functools.partial(self._tap, name))

    @torch.no_grad()
    def _tap(self, name, router, args, output) -> None:
        if _in_backward():
            return
        hidden = args[0]
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float())
        routing_map = output[1]
        z = torch.logsumexp(logits, dim=-1)
        row = torch.cat(
            [
                routing_map.reshape(-1, self.experts).sum(dim=0).double(),
                torch.softmax(logits, dim=-1).sum(dim=0).double(),
                (z * z).sum().double().reshape(1),
                torch.tensor([logits.shape[0]], dtype=torch.float64, device=logits.device),
            ]
        )
        self.pending[name].append(row)

    def step_done(self) -> None:
        """Sum this step's rows over the tp ranks and add each forward's statistics (collective over tp)."""
        names = [n for n in self.pending if self.pending[n]]
        if not names:
            return
        rows = torch.stack([r for n in names for r in self.pending[n]])
        if self.tp_size > 1:
            with harness_sync():  # the harness's statistics, not the engine's traffic
                dist.all_reduce(rows, group=self.tp_group)
        at = 0
        e = self.experts
        for n in names:
            for row in rows[at : at + len(self.pending[n])]:
                r = RouterInputs(row[:e], row[e : 2 * e], row[2 * e], int(row[2 * e + 1]))
                aux, z = router_losses(r, self.k)
                self.stats[n].add(r.counts, aux, z)
            at += len(self.pending[n])
            self.pending[n] = []

    def take(self) -> dict[str, dict]:
        """Each MoE layer's statistics since the last call (then reset), on tp rank 0; {} on the others."""
        taken = {name: s.take() for name, s in self.stats.items()}
        return taken if self.report else {}
