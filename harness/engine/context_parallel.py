"""Context parallelism: attention over a sequence whose tokens are split across the cp ranks.

Each rank holds chunks i and 2cp-1-i of every sequence (harness.model.llama.cp_token_index: causal
load balancing), in that order, for the queries, keys and values of its heads. `attention` is the
one entry the own engine's blocks call instead of the attention core when cp > 1; it takes q, k, v
as [batch, heads, local_seq, head_dim] after rotary (k and v with their KV heads, not repeated for
grouped-query attention) and returns the rank's output rows, differentiable in q, k and v: the
gradients of the other ranks' keys and values go back to them through the same axis.

Implementations (layout.cp_impl), every byte through the counted Axis (comm.py):
  allgather  Llama 3's way: the K/V shards are all-gathered (forward) and their gradients
             reduce-scattered (backward); each rank masks its own chunks causally.
"""

from __future__ import annotations

import math

import torch

from harness.engine.comm import Axis
from harness.model.llama import cp_token_index


def _seq_first(t: torch.Tensor) -> torch.Tensor:
    return t.permute(2, 0, 1, 3).contiguous()   # [b, h, s, d] -> [s, b, h, d]: the Axis gathers dim 0


class _GatherSequence(torch.autograd.Function):
    """[b, h, s_local, d] -> [b, h, seq, d] in global token order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, t, axis: Axis, order: torch.Tensor):
        ctx.axis, ctx.order = axis, order
        gathered = axis.all_gather(_seq_first(t))          # rank order: every rank's chunks in its order
        full = torch.empty_like(gathered)
        full[order] = gathered                              # global order
        return full.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        grad = _seq_first(grad)[ctx.order]                  # back to rank order
        mine = ctx.axis.reduce_scatter(grad.contiguous())
        return mine.permute(1, 2, 0, 3), None, None


def _masked_core(q, k, v, q_pos, k_pos):
    """softmax(QKᵀ/√d)V in fp32 with key position <= query position (what naive computes)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def attention(q, k, v, axis: Axis, impl: str):
    """The rank's attention output [b, hq, s_local, d] (see the module docstring)."""
    cp, index = axis.size, axis.index
    seq = q.shape[2] * cp
    q_pos = cp_token_index(seq, cp, index, q.device)
    if impl == "allgather":
        order = torch.cat([cp_token_index(seq, cp, r, q.device) for r in range(cp)])
        k, v = _GatherSequence.apply(k, axis, order), _GatherSequence.apply(v, axis, order)
        return _masked_core(q, k, v, q_pos, torch.arange(seq, device=q.device))
    raise NotImplementedError(f"cp_impl {impl!r}")
