"""Context parallelism: attention over a sequence whose tokens are split across the cp ranks.

Each rank holds chunks i and 2cp-1-i of every sequence (harness.model.llama.cp_token_index: causal
load balancing), in that order, for the queries, keys and values of its heads. `attention` is the
one entry the own engine's blocks call instead of the attention core when cp > 1; it takes q, k, v
as [batch, heads, local_seq, head_dim] after rotary (k and v with their KV heads, not repeated for
grouped-query attention) and returns the rank's output rows, differentiable in q, k and v: the
gradients of the other ranks' keys and values go back to them through the same axis.

Implementations (layout.cp_impl), every byte through the counted Axis (comm.py):
  ring       K and V (packed in one buffer, KV heads unexpanded) pass round the cp ring by P2P;
             the next block's transfer is posted before the current block is computed, so it
             overlaps. Blocks are computed in fp32 (naive's math, masks by position) and merged by
             online softmax (log-sum-exp). Backward (flash-attention style) recomputes each block's
             probabilities from the saved LSE; K/V rotate again, and the fp32 dK/dV accumulator of
             each block travels with it, so after cp hops every rank's K/V gradient is home.
             With rank i's chunks (i, 2cp-1-i) and block j's (j, 2cp-1-j): j == i is causal over the
             local 2c tokens; j < i: all local queries against j's first chunk only; j > i: the
             local second chunk's queries against all of j's keys (every other pair is masked out).
             In flight (the planner's K/V term): forward the current and the next K/V block
             (2 x 2·b·hkv·s_local·d in the activations' dtype); backward those two plus the dK/dV
             accumulator arriving and the one leaving (2 x 2·b·hkv·s_local·d in fp32).
             Saved for backward: q, the local k and v, the fp32 output and LSE (b·hq·s_local).
  allgather  Llama 3's way: K/V (packed) all-gathered, one masked fp32 block against the whole
             sequence; backward all-gathers them again (only the local K/V are saved, as
             Transformer Engine does) and reduce-scatters the fp32 dK/dV. In flight: the gathered
             K/V (2·b·hkv·seq·d) and in backward their fp32 gradient.
  ulysses    DeepSpeed's way: one all-to-all swaps the sequence shard of q, k, v (packed) for a
             head shard of the whole sequence, the layout's kernel runs causally on it
             (attention_core: GQA repeat), one all-to-all brings the output back; backward is the
             reverse all-to-all of the gradients, in the activations' dtype.

Checkpointing: `recompute=True` (selective) recomputes only the rank-local math: ring and
allgather keep no O(s²) tensor anyway (their backward recomputes the probabilities), so it
changes nothing for them; ulysses runs its kernel under checkpoint between the all-to-alls. No
communication is repeated. Under full checkpointing (the block re-run by torch's non-reentrant
checkpoint) the whole forward of `attention` runs again in backward, its communication included:
ring's cp-1 K/V hops, allgather's gather, ulysses's two all-to-alls (the second because the
block's wo keeps the output; with early stop and nothing keeping it, only the first would rerun).
All ranks re-run the same block at the same point of their backward, so the repeated P2P and
collectives match. comm_model.cp_attention_calls is the closed form of all of this.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from harness.engine.comm import Axis
from harness.model.llama import attention_core, cp_token_index

KV, DKV = 0, 1   # P2P tags: the K/V block and its gradient accumulator travel side by side


def _core_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)   # fp32 (naive's), fp64 only for fp64 inputs


# ---------------------------------------------------------------- blocks (masks by position)

def _grouped(q, hkv):
    """[b, hq, s, d] -> [b, hkv, g, s, d]: query head h uses KV head h // g (repeat_interleave's map)."""
    b, hq, s, d = q.shape
    return q.reshape(b, hkv, hq // hkv, s, d)


def _scores(qg, k, q_pos, k_pos):
    """Masked QKᵀ/√d, [b, hkv, g, sq, sk]: key position > query position is -inf."""
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) / math.sqrt(qg.shape[-1])
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def block_forward(qg, k, v, q_pos, k_pos):
    """One block: its normalised output [b, hkv, g, sq, d] and LSE [b, hkv, g, sq] (core dtype in, out)."""
    s = _scores(qg, k, q_pos, k_pos)
    m = s.amax(-1, keepdim=True).detach()   # the result does not depend on m: no gradient through it
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.unsqueeze(2)) / total
    return out, (m + torch.log(total)).squeeze(-1)


def block_backward(qg, k, v, q_pos, k_pos, dog, lse, delta):
    """dq [b, hkv, g, sq, d], dk and dv [b, hkv, sk, d] of one block from the merged LSE and
    delta = rowsum(dO·O): P = exp(S - LSE), dS = P·(dP - delta)."""
    p = torch.exp(_scores(qg, k, q_pos, k_pos) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) / math.sqrt(qg.shape[-1])
    dq = torch.matmul(ds, k.unsqueeze(2))
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2)
    return dq, dk, dv


def _merge(out, lse, rows, b_out, b_lse):
    """Online softmax: fold a block's (output, LSE) into the running ones at query rows `rows`."""
    o, l_ = out[..., rows, :], lse[..., rows]
    new = torch.logaddexp(l_, b_lse)
    out[..., rows, :] = o * torch.exp(l_ - new).unsqueeze(-1) + b_out * torch.exp(b_lse - new).unsqueeze(-1)
    lse[..., rows] = new


# ---------------------------------------------------------------- ring

def _ring_rows(i: int, j: int, c: int):
    """(query rows, key columns) of rank i's queries that can see block j (the module docstring)."""
    everything = slice(None)
    if j == i:
        return everything, everything
    return (everything, slice(0, c)) if j < i else (slice(c, 2 * c), everything)


def _pack(k, v):
    return torch.stack([k, v]).contiguous()


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis):
        cp, i = axis.size, axis.index
        s_local, hkv = q.shape[2], k.shape[1]
        c, seq, dt = s_local // 2, s_local * cp, _core_dtype(q.dtype)
        nxt, prv = (i + 1) % cp, (i - 1) % cp
        q_pos = cp_token_index(seq, cp, i, q.device)
        qg = _grouped(q.to(dt), hkv)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=dt, device=q.device)
        kv = _pack(k, v)
        for t in range(cp):
            j = (i - t) % cp
            if t < cp - 1:   # post the next block's transfer before computing on this one
                incoming = torch.empty_like(kv)
                works = axis.exchange([(kv, nxt)], [(incoming, prv)], tag=KV)
            rows, cols = _ring_rows(i, j, c)
            k_pos = cp_token_index(seq, cp, j, q.device)
            b_out, b_lse = block_forward(qg[..., rows, :], kv[0, :, :, cols].to(dt), kv[1, :, :, cols].to(dt),
                                         q_pos[rows], k_pos[cols])
            _merge(out, lse, rows, b_out, b_lse)
            if t < cp - 1:
                axis.wait(works)
                kv = incoming
        ctx.axis = axis
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        axis = ctx.axis
        cp, i = axis.size, axis.index
        s_local, hkv = q.shape[2], k.shape[1]
        c, seq, dt = s_local // 2, s_local * cp, _core_dtype(q.dtype)
        nxt, prv = (i + 1) % cp, (i - 1) % cp
        q_pos = cp_token_index(seq, cp, i, q.device)
        qg = _grouped(q.to(dt), hkv)
        dog = _grouped(grad.to(dt), hkv)
        delta = (dog * out).sum(-1)
        dq = torch.zeros_like(qg)
        kv = _pack(k, v)
        arriving, dkv_works = None, []   # the dK/dV accumulator of this step's block, on its way from rank i-1
        for t in range(cp):
            j = (i - t) % cp
            if t < cp - 1:
                incoming = torch.empty_like(kv)
                kv_works = axis.exchange([(kv, nxt)], [(incoming, prv)], tag=KV)
            rows, cols = _ring_rows(i, j, c)
            k_pos = cp_token_index(seq, cp, j, q.device)
            bq, bk, bv = block_backward(qg[..., rows, :], kv[0, :, :, cols].to(dt), kv[1, :, :, cols].to(dt),
                                        q_pos[rows], k_pos[cols], dog[..., rows, :], lse[..., rows],
                                        delta[..., rows])
            dq[..., rows, :] += bq
            if arriving is None:
                dkv = torch.zeros((2, *k.shape), dtype=dt, device=k.device)
            else:
                axis.wait(dkv_works)
                dkv = arriving
            dkv[0, :, :, cols] += bk
            dkv[1, :, :, cols] += bv
            arriving = torch.empty_like(dkv)   # block j's accumulator goes on; block j-1's comes in
            dkv_works = axis.exchange([(dkv, nxt)], [(arriving, prv)], tag=DKV)
            if t < cp - 1:
                axis.wait(kv_works)
                kv = incoming
        axis.wait(dkv_works)   # after cp hops the accumulator arriving is this rank's own block's
        return dq.reshape(q.shape).to(q.dtype), arriving[0].to(k.dtype), arriving[1].to(v.dtype), None


# ---------------------------------------------------------------- allgather

def _seq_first(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(-2, 0).contiguous()   # [..., s, d] -> [s, ..., d]: the Axis gathers dim 0


def _gather_kv(k, v, axis: Axis, order):
    """The packed K/V [2, b, hkv, seq, d] of the whole sequence in global token order."""
    gathered = axis.all_gather(_seq_first(_pack(k, v)))      # rank order: every rank's chunks in its order
    full = torch.empty_like(gathered)
    full[order] = gathered
    return full.movedim(0, -2)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis):
        cp, i = axis.size, axis.index
        seq, hkv, dt = q.shape[2] * cp, k.shape[1], _core_dtype(q.dtype)
        order = torch.cat([cp_token_index(seq, cp, r, q.device) for r in range(cp)])
        kv = _gather_kv(k, v, axis, order).to(dt)
        out, lse = block_forward(_grouped(q.to(dt), hkv), kv[0], kv[1], cp_token_index(seq, cp, i, q.device),
                                 torch.arange(seq, device=q.device))
        ctx.axis, ctx.order = axis, order
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        axis, order = ctx.axis, ctx.order
        cp, i = axis.size, axis.index
        seq, hkv, dt = q.shape[2] * cp, k.shape[1], _core_dtype(q.dtype)
        kv = _gather_kv(k, v, axis, order).to(dt)
        dog = _grouped(grad.to(dt), hkv)
        dq, dk, dv = block_backward(_grouped(q.to(dt), hkv), kv[0], kv[1], cp_token_index(seq, cp, i, q.device),
                                    torch.arange(seq, device=q.device), dog, lse, (dog * out).sum(-1))
        dkv = _seq_first(torch.stack([dk, dv]))[order]             # back to rank order
        mine = axis.reduce_scatter(dkv.contiguous()).movedim(0, -2)
        return dq.reshape(q.shape).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None


# ---------------------------------------------------------------- ulysses

class _AllToAll(torch.autograd.Function):
    """[cp, ...]: piece r goes to rank r, piece r of the result came from rank r; its own adjoint."""

    @staticmethod
    def forward(ctx, t, axis: Axis):
        ctx.axis = axis
        return axis.all_to_all(t.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.axis.all_to_all(grad.contiguous()), None


def _ulysses(q, k, v, axis: Axis, kernel, recompute: bool):
    cp = axis.size
    b, hq, s_local, d = q.shape
    hkv = k.shape[1]
    seq = s_local * cp
    order = torch.cat([cp_token_index(seq, cp, r, q.device) for r in range(cp)])
    to_global = torch.argsort(order)    # global position p sits at rank-order index to_global[p]
    split = [hq // cp, hkv // cp, hkv // cp]
    # [b, h, s, d] -> [cp, b, h/cp, s, d]: head shard r of this rank's tokens goes to rank r
    packed = torch.cat([t.reshape(b, cp, t.shape[1] // cp, s_local, d) for t in (q, k, v)], dim=2).movedim(1, 0)
    mine = _AllToAll.apply(packed, axis)                      # [cp (source rank), b, H/cp, s_local, d]
    whole = mine.permute(1, 2, 0, 3, 4).reshape(b, sum(split), seq, d)[:, :, to_global]
    qh, kh, vh = whole.split(split, dim=1)
    if recompute and torch.is_grad_enabled():
        out = checkpoint(attention_core, qh, kh, vh, kernel, use_reentrant=False)
    else:
        out = attention_core(qh, kh, vh, kernel)
    back = out[:, :, order].reshape(b, hq // cp, cp, s_local, d).permute(2, 0, 1, 3, 4)
    return _AllToAll.apply(back, axis).movedim(0, 1).reshape(b, hq, s_local, d)


# ---------------------------------------------------------------- entry

def attention(q, k, v, axis: Axis, impl: str, kernel=None, recompute: bool = False):
    """The rank's attention output [b, hq, s_local, d] (see the module docstring). kernel: the
    layout's attention function (ulysses runs it; ring and allgather compute naive's math)."""
    if axis.size == 1:
        from harness.model.kernels import attention_naive

        return attention_core(q, k, v, kernel or attention_naive)
    if impl == "ring":
        return _Ring.apply(q, k, v, axis)
    if impl == "allgather":
        return _AllGather.apply(q, k, v, axis)
    if impl == "ulysses":
        if kernel is None:
            raise ValueError("ulysses runs the layout's attention kernel: pass kernel=")
        return _ulysses(q, k, v, axis, kernel, recompute)
    raise NotImplementedError(f"cp_impl {impl!r}")
