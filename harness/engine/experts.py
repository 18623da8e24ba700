"""The own engine's mixture-of-experts feed-forward, Megatron's way: experts shared out over the expert-
parallel ranks (layout.ep) and reached by all-to-all, inside the block's tensor-parallel region.

The router, its losses and the experts are harness.model.moe's (MoEFeedForward: `gate`, `attach_losses`,
RouterInputs); this module holds only this ep rank's experts, keyed by their global index so parameter
names are the reference's, [index·E/ep, (index+1)·E/ep). One forward over tokens x [T, hidden]:
- route every token (fp32, top-k) and sort the routed (token, slot) pairs by expert (stable: within one
  expert in token order, as the reference's nonzero());
- exchange the per-expert counts (an all-to-all of E numbers), then the token rows, unequal splits;
- group the received rows by expert, run each held expert on its rows (an expert with none runs on an
  empty batch, so its gradient is zeros, as the reference's);
- send the results back (the reverse all-to-all: the combine), weight them and add them into their
  tokens in expert order with one index_add, as the reference's per-expert index_adds sum them.
The exchanges are autograd Functions whose backward is the reverse exchange.

Under tensor parallelism the layer sits where the dense MLP does: region.enter (all-gather under SP)
gives every tp rank the micro-batch's tokens, they route identically, each ep peer is the rank with the
same tp index, the experts are SwiGLUs at width moe_ffn/tp (w1/w3 column-, w2 row-parallel: partial
sums, which region.leave reduces). The router's weight is replicated across tp, but its gradient is a
partial sum per tp rank (through the combine weights of partial expert outputs): it is summed over tp
before the data-parallel reduction (its Sharding's tp_partial, harness.engine.data_parallel). So that the aux
losses' gradient (the same on every tp rank) is not counted tp times by that sum and by region.enter's
backward, each tp rank injects 1/tp of it (`aux_scale`, set by the engine).
"""

from __future__ import annotations

import torch

from harness.engine.comm import Axis
from harness.engine.parallel import ParallelContext
from harness.engine.partition import shard, shard_swiglu
from harness.model.moe import MoEFeedForward, RouterInputs
from harness.model.presets import Shape


def held_experts(shape: Shape, ep: Axis | None) -> range:
    """The experts (global indices) this ep rank holds: the ep-th share at its index, all without ep."""
    if ep is None or ep.size == 1:
        return range(shape.experts)
    per = shape.experts // ep.size
    return range(ep.index * per, (ep.index + 1) * per)


def sort_by_expert(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (order [T·k]: the routed slots sorted by expert, stable; token [T·k]: each sorted
    slot's token; counts [E]: slots per expert)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // experts.shape[-1], torch.bincount(flat, minlength=n_experts)


def group_by_expert(recv_counts: list[list[int]], device=None) -> tuple[torch.Tensor, list[int]]:
    """recv_counts [ep][L]: row r holds source rank r's rows for each of the L held experts, in that order
    (what the dispatch receives, source after source). -> (perm: the received rows grouped by expert,
    sources in rank order within one; rows per held expert)."""
    held = len(recv_counts[0])
    starts, at = [], 0
    for row in recv_counts:
        starts.append([])
        for c in row:
            starts[-1].append(at)
            at += c
    pieces = [range(starts[r][j], starts[r][j] + row[j]) for j in range(held) for r, row in enumerate(recv_counts)]
    perm = torch.tensor([i for p in pieces for i in p], dtype=torch.long)  # built on the host, one copy over
    return perm.to(device) if device is not None else perm, [sum(row[j] for row in recv_counts) for j in range(held)]


def run_held_experts(experts, received: torch.Tensor, recv_counts: list[list[int]]) -> torch.Tensor:
    """The held experts over the rows the dispatch received (recv_counts as group_by_expert reads them),
    each expert on its rows at once, the outputs back in the received order for the combine."""
    perm, sizes = group_by_expert(recv_counts, received.device)
    grouped = received[perm]
    outs, at = [], 0
    for expert, n in zip(experts, sizes, strict=True):
        outs.append(expert(grouped[at : at + n]))
        at += n
    back = torch.empty_like(perm)
    back[perm] = torch.arange(perm.numel(), device=perm.device)
    return torch.cat(outs)[back]


def splits(counts: list[int], ep: int) -> list[int]:
    """Rows per ep rank of a count per expert [E] (rank r holds experts [r·E/ep, (r+1)·E/ep))."""
    per = len(counts) // ep
    return [sum(counts[r * per : (r + 1) * per]) for r in range(ep)]


class _Exchange(torch.autograd.Function):
    """The rows of x to the ep ranks (send[r] rows to rank r; recv[r] come from rank r); backward is the
    reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, axis: Axis, send: list[int], recv: list[int]):
        ctx.axis, ctx.send, ctx.recv = axis, send, recv
        return axis.all_to_all_v(x, send, recv)

    @staticmethod
    def backward(ctx, g):
        return ctx.axis.all_to_all_v(g.contiguous(), ctx.recv, ctx.send), None, None, None


class _SumOverRanks(torch.autograd.Function):
    """All-reduce forward, identity backward: each rank's part of a sum keeps the gradient of the whole
    (the same on every rank), so the replicas' gradient sum counts each rank's part once."""

    @staticmethod
    def forward(ctx, t, axis: Axis):
        t = t.clone()
        axis.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g):
        return g, None


def summed_over(r: RouterInputs, cp: Axis | None) -> RouterInputs:
    """The router statistics of one micro-batch whose sequences the cp ranks share (moe.py: the losses
    are not additive over tokens, their inputs are): one all-reduce of counts, probabilities, z and tokens."""
    if cp is None or cp.size == 1:
        return r
    e = r.counts.shape[0]
    tokens = torch.full((1,), float(r.tokens), device=r.counts.device)
    packed = _SumOverRanks.apply(torch.cat([r.counts, r.prob_sum, r.z_sum.reshape(1), tokens]), cp)
    return RouterInputs(packed[:e].detach(), packed[e : 2 * e], packed[2 * e], int(packed[2 * e + 1].item()))


class ExpertParallelMoE(MoEFeedForward):
    """harness.model.moe's MoE feed-forward holding this ep rank's experts at width moe_ffn/tp.
    forward: x [..., hidden] (the TP region's input: every token of the micro-batch, or under context
    parallelism this cp rank's share of its sequences) -> [..., hidden] (under tp a partial sum of the
    experts' outputs, for region.leave). Under cp the losses' statistics are summed over the cp ranks
    (summed_over): every cp rank computes the micro-batch's losses, each rank's tokens carry their part
    of the gradient (the replica reduction over dp x cp adds them), and the statistics are recorded on
    cp index 0 only (the engine's router_stats).

    `routing` (ChunkOptions.routing), when given, says how many routed slots each expert gets, (slots,
    experts) -> counts, in place of the data's: the slots are taken in token order, every rank is taken to
    route as this one (no exchange of counts), and no statistics or losses are attached (they are the
    data's). harness memory's trace on fake tensors, which have no data, routes so (evenly)."""

    def __init__(self, shape: Shape, parallel: ParallelContext, routing=None):
        super().__init__(shape, held_experts(shape, parallel.ep), shape.moe_ffn // parallel.tp.size)
        shard(self.router.weight, tp_partial=True)
        for expert in self.experts.values():
            shard_swiglu(expert, expert=True)
        self.ep = parallel.ep if parallel.ep.size > 1 else None
        self.cp = parallel.cp
        self.routing = routing

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        weights, experts, probs, logits = self.gate(x2)
        given = self.routing is not None
        if given:
            order = torch.arange(experts.numel(), device=x2.device)
            token, counts = order // self.k, self.routing(experts.numel(), self.n_experts)
        else:
            order, token, counts_t = sort_by_expert(experts, self.n_experts)
            counts = counts_t.tolist()
        rows = x2[token]  # the routed slots' inputs, sorted by expert
        ep = 1 if self.ep is None else self.ep.size
        held = self.n_experts // ep
        if ep == 1:
            recv_counts, received = [counts], rows
        else:
            if given:  # every rank routes as this one
                mine = counts[self.ep.index * held : (self.ep.index + 1) * held]
                recv_counts = [mine] * ep
            else:  # source r's counts for my experts
                recv_counts = self.ep.all_to_all(counts_t).view(ep, held).tolist()
            send, recv = splits(counts, ep), [sum(r) for r in recv_counts]
            received = _Exchange.apply(rows, self.ep, send, recv)
        y = run_held_experts(self.experts.values(), received, recv_counts)  # in the received order again
        if ep > 1:
            y = _Exchange.apply(y, self.ep, recv, send)  # the combine: rows back to their tokens' ranks
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x2).index_add(0, token, y)
        if given:  # the statistics are the data's: none with given counts
            return out.view_as(x)
        return self.attach_losses(out, summed_over(RouterInputs.of(logits, experts, probs), self.cp)).view_as(x)
