"""Megatron-style tensor and sequence parallel regions, vocab-parallel embedding and loss.

Activations are [seq, batch, hidden] (Megatron's order) so that sequence-parallel shards are
contiguous slices along dim 0 and the all-gather / reduce-scatter need no copies.

A TP region is entered before the column-parallel projections and left after the row-parallel
one. Without SP: enter = identity forward / all-reduce backward (Megatron's f), leave =
all-reduce forward / identity backward (g). With SP (Korthikanti et al. 2022) the norms and
residuals hold a 1/tp slice of the sequence: enter = all-gather forward / reduce-scatter
backward, leave = reduce-scatter forward / all-gather backward. Each is one explicit
collective through comm.Axis, so it is counted. They move activations (or their gradients) in
the activation dtype, the parameters' (bf16 under precision bf16); only the vocab-parallel
loss's reductions are fp32 (its math is).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.engine.comm import Axis
from harness.model.llama import lm_loss


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis: Axis):
        ctx.axis = axis
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        ctx.axis.all_reduce(g)
        return g, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis: Axis):
        # a row-parallel output nobody else holds: sum it in place (not a view: torchao's FP8 matmul returns
        # its output as a view of the 2-D GEMM's, which autograd does not let be modified in place)
        if x.is_contiguous() and not x._is_view():
            axis.all_reduce(x)
            ctx.mark_dirty(x)
            return x
        x = x.contiguous()
        axis.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis: Axis):
        ctx.axis = axis
        return axis.all_gather(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.axis.reduce_scatter(g), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis: Axis):
        ctx.axis = axis
        return axis.reduce_scatter(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.axis.all_gather(g), None


class Region:
    """Enter/leave a tensor-parallel region over `axis`, with or without sequence parallelism."""

    def __init__(self, tp: Axis, sequence_parallel: bool):
        self.tp = tp
        self.sp = tp.labelled("sp") if sequence_parallel else None
        self.active = tp.size > 1

    def enter(self, x):
        if not self.active:
            return x
        return _Gather.apply(x, self.sp) if self.sp else _Copy.apply(x, self.tp)

    def leave(self, x):
        if not self.active:
            return x
        return _Scatter.apply(x, self.sp) if self.sp else _Reduce.apply(x, self.tp)


# ------------------------------------------------------------------ vocab parallel


def vocab_range(vocab: int, tp_size: int, tp_index: int) -> tuple[int, int]:
    per = vocab // tp_size
    return tp_index * per, (tp_index + 1) * per


def vocab_parallel_embedding(tokens, weight, region: Region, start: int):
    """tokens [s, b] -> [s(/tp), b, h]: each rank looks up its vocabulary slice, zeros the rest,
    and the region's leave() sums (or reduce-scatters) the partial rows."""
    if not region.active:
        return torch.nn.functional.embedding(tokens, weight)
    local = tokens - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return region.leave(out)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary; full logits never exist anywhere.

    Two all-reduces per call: the row max (MAX), then the target logit and the sum of
    exponentials together (SUM). Megatron sends the last two separately; stacking them halves
    the latency cost at no extra bytes.
    """

    @staticmethod
    def forward(ctx, logits, target, axis: Axis, start: int):
        dtype = logits.dtype
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        axis.all_reduce(row_max, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        both = torch.stack([picked, exp.sum(dim=-1)])
        axis.all_reduce(both)
        picked, sum_exp = both[0], both[1]
        exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(exp, local, outside)
        ctx.dtype = dtype
        return torch.log(sum_exp) - picked

    @staticmethod
    def backward(ctx, g):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None  # as logits.float()'s backward casts it


def vocab_parallel_cross_entropy(logits, target, axis: Axis, start: int):
    """Per-token loss; logits [N, V/tp] (fp32 math), target [N] global ids."""
    if axis.size == 1:
        return lm_loss(logits, target, reduction="none")
    return _VocabParallelCE.apply(logits, target, axis, start)
