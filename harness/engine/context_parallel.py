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
             overlaps. Blocks are computed in fp32 (naive's math, masks by position) or, for the
             layout's sdpa kernels, by torch's attention op that returns the LSE (lse_attention.py:
             flash on CPU, what sdpa runs there, bitwise; flash, efficient or cuDNN on CUDA; sdpa:
             the one torch's dispatcher picks), the diagonal block with is_causal, the others with no
             mask, and merged by online softmax (log-sum-exp) in fp32.
             Backward (flash-attention style) recomputes each block's probabilities from the saved
             LSE; K/V rotate again, and the fp32 dK/dV accumulator of each block travels with it,
             so after cp hops every rank's K/V gradient is home.
             With rank i's chunks (i, 2cp-1-i) and block j's (j, 2cp-1-j): j == i is causal over the
             local 2c tokens; j < i: all local queries against j's first chunk only; j > i: the
             local second chunk's queries against all of j's keys (every other pair is masked out).
             In flight (the planner's K/V term): forward the current and the next K/V block
             (2 x 2·b·hkv·s_local·d in the activations' dtype); backward those two plus the dK/dV
             accumulator arriving and the one leaving (2 x 2·b·hkv·s_local·d in fp32).
             Saved for backward: q, the local k and v, the fp32 output and LSE (b·hq·s_local); for
             the CUDA ops also what each block's forward returned for its backward op (RNG state,
             a few scalars). Each op block takes K/V repeated to the query heads (transient).
             Transient, one block at a time: naive's fp32 scores and probabilities, at most
             b·hq·s_local² each (the own block; the others are half that), the ops' none of that size.
  allgather  Llama 3's way: K/V (packed) all-gathered, then the ring's blocks (naive or an op) cut
             from the gathered buffer, one per source rank; backward all-gathers them again (only
             the local K/V are saved, as Transformer Engine does) and reduce-scatters the fp32
             dK/dV. In flight: the gathered K/V (cp x 2·b·hkv·s_local·d) and in backward their fp32
             gradient (the same size in fp32).
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
from harness.engine.lse_attention import LSE_KERNELS, lse_op
from harness.model.llama import attention_core, cp_token_index

KV, DKV = 0, 1  # P2P tags: the K/V block and its gradient accumulator travel side by side


def _core_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 (naive's), fp64 only for fp64 inputs


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
    m = s.amax(-1, keepdim=True).detach()  # the result does not depend on m: no gradient through it
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


# ---------------------------------------------------------------- blocks of one source rank


def _ring_rows(i: int, j: int, c: int):
    """(query rows, key columns) of rank i's queries that can see block j (the module docstring)."""
    everything = slice(None)
    if j == i:
        return everything, everything
    return (everything, slice(0, c)) if j < i else (slice(c, 2 * c), everything)


def _pack(k, v):
    return torch.stack([k, v]).contiguous()


def _flat(t):
    return t.reshape(t.shape[0], -1, *t.shape[-2:])  # [b, hkv, g, s, d] -> [b, hq, s, d]


class _Blocks:
    """Rank i's queries against the K/V block of one source rank j at a time, merged by online
    softmax: what ring (blocks arriving by P2P) and allgather (blocks cut from the gathered K/V)
    share. naive (op None): masked fp32 math (block_forward/backward). Otherwise `op`, one of
    lse_attention's adapters (torch's flash, efficient or cuDNN op, which return the LSE): is_causal
    for the diagonal block, no mask for the others (their rows and columns are cut by _ring_rows),
    K/V repeated to the query heads; its backward is given the merged output and LSE, so its
    probabilities are the whole row's. `aux`: what each block's forward returned for its backward."""

    def __init__(self, q, hkv: int, cp: int, i: int, op, aux=None):
        self.cp, self.i, self.c, self.seq, self.op = cp, i, q.shape[2] // 2, q.shape[2] * cp, op
        self.dt, self.dtype, self.hkv, self.aux = _core_dtype(q.dtype), q.dtype, hkv, {} if aux is None else aux
        self.q_pos = cp_token_index(self.seq, cp, i, q.device)
        self.qg = _grouped(q if op else q.to(self.dt), hkv)  # the ops compute from the inputs' dtype

    def _pos(self, j, rows, cols):
        return self.q_pos[rows], cp_token_index(self.seq, self.cp, j, self.q_pos.device)[cols]

    def start(self):
        out = torch.zeros(self.qg.shape, dtype=self.dt, device=self.qg.device)
        return out, torch.full(out.shape[:-1], float("-inf"), dtype=self.dt, device=out.device)

    def _kv(self, kv, cols):
        g = self.qg.shape[2]
        return kv[0, :, :, cols].repeat_interleave(g, 1), kv[1, :, :, cols].repeat_interleave(g, 1)

    def forward(self, out, lse, j: int, kv) -> None:
        rows, cols = _ring_rows(self.i, j, self.c)
        qg = self.qg[..., rows, :]
        if self.op:
            o, b_lse, self.aux[j] = self.op.forward(_flat(qg), *self._kv(kv, cols), j == self.i)
            b_out, b_lse = o.reshape(qg.shape).to(self.dt), b_lse.reshape(qg.shape[:-1]).to(self.dt)
        else:
            k, v = kv[0, :, :, cols].to(self.dt), kv[1, :, :, cols].to(self.dt)
            b_out, b_lse = block_forward(qg, k, v, *self._pos(j, rows, cols))
        _merge(out, lse, rows, b_out, b_lse)

    def backward_setup(self, grad, out):
        """What every block's backward needs: dO (grouped) and delta, or for an op the output as returned."""
        if self.op:
            return _grouped(grad, self.hkv), out.to(self.dtype)
        dog = _grouped(grad.to(self.dt), self.hkv)
        return dog, (dog * out).sum(-1)

    def backward(self, dq, j: int, kv, dog, lse, extra):
        """Adds block j's dQ into dq; returns (key columns, dK, dV) of block j in the core dtype."""
        rows, cols = _ring_rows(self.i, j, self.c)
        qg = self.qg[..., rows, :]
        if self.op:
            g = qg.shape[2]
            lse_rows = _flat(lse[..., rows].unsqueeze(-1)).squeeze(-1)
            bq, bk, bv = self.op.backward(
                _flat(dog[..., rows, :]),
                _flat(qg),
                *self._kv(kv, cols),
                _flat(extra[..., rows, :]),
                lse_rows,
                j == self.i,
                self.aux[j],
            )
            bq = bq.reshape(qg.shape).to(self.dt)
            bk = bk.reshape(bk.shape[0], self.hkv, g, *bk.shape[-2:]).sum(2, dtype=self.dt)
            bv = bv.reshape(bv.shape[0], self.hkv, g, *bv.shape[-2:]).sum(2, dtype=self.dt)
        else:
            k, v = kv[0, :, :, cols].to(self.dt), kv[1, :, :, cols].to(self.dt)
            bq, bk, bv = block_backward(
                qg, k, v, *self._pos(j, rows, cols), dog[..., rows, :], lse[..., rows], extra[..., rows]
            )
        dq[..., rows, :] += bq
        return cols, bk, bv


# ---------------------------------------------------------------- ring


def _backward_start(ctx, grad):
    """What ring's and allgather's backward both begin with: the saved tensors, the axis, this rank's
    blocks, the output gradient as the blocks take it, and a zero dq in the core dtype."""
    q, k, v, out, lse = ctx.saved_tensors
    blocks = _Blocks(q, k.shape[1], ctx.axis.size, ctx.axis.index, ctx.op, ctx.aux)
    dog, extra = blocks.backward_setup(grad, out)
    dq = torch.zeros(blocks.qg.shape, dtype=blocks.dt, device=q.device)
    return q, k, v, lse, ctx.axis, blocks, dog, extra, dq


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, op):
        cp, i = axis.size, axis.index
        nxt, prv = (i + 1) % cp, (i - 1) % cp
        blocks = _Blocks(q, k.shape[1], cp, i, op)
        out, lse = blocks.start()
        kv = _pack(k, v)
        for t in range(cp):
            if t < cp - 1:  # post the next block's transfer before computing on this one
                incoming = torch.empty_like(kv)
                works = axis.exchange([("send", kv, nxt), ("recv", incoming, prv)], tag=KV)
            blocks.forward(out, lse, (i - t) % cp, kv)
            if t < cp - 1:
                axis.wait(works)
                kv = incoming
        ctx.axis, ctx.op, ctx.aux = axis, op, blocks.aux
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, lse, axis, blocks, dog, extra, dq = _backward_start(ctx, grad)
        cp, i = axis.size, axis.index
        nxt, prv = (i + 1) % cp, (i - 1) % cp
        kv = _pack(k, v)
        arriving, dkv_works = None, []  # the dK/dV accumulator of this step's block, on its way from rank i-1
        for t in range(cp):
            if t < cp - 1:
                incoming = torch.empty_like(kv)
                kv_works = axis.exchange([("send", kv, nxt), ("recv", incoming, prv)], tag=KV)
            cols, bk, bv = blocks.backward(dq, (i - t) % cp, kv, dog, lse, extra)
            if arriving is None:
                dkv = torch.zeros((2, *k.shape), dtype=blocks.dt, device=k.device)
            else:
                axis.wait(dkv_works)
                dkv = arriving
            dkv[0, :, :, cols] += bk
            dkv[1, :, :, cols] += bv
            arriving = torch.empty_like(dkv)  # block j's accumulator goes on; block j-1's comes in
            dkv_works = axis.exchange([("send", dkv, nxt), ("recv", arriving, prv)], tag=DKV)
            if t < cp - 1:
                axis.wait(kv_works)
                kv = incoming
        axis.wait(dkv_works)  # after cp hops the accumulator arriving is this rank's own block's
        return dq.reshape(q.shape).to(q.dtype), arriving[0].to(k.dtype), arriving[1].to(v.dtype), None, None


# ---------------------------------------------------------------- allgather


def _gather_kv(k, v, axis: Axis):
    """Every rank's packed K/V, [cp, 2, b, hkv, s_local, d] in rank order (the Axis gathers dim 0)."""
    return axis.all_gather(_pack(k, v).unsqueeze(0))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: Axis, op):
        blocks = _Blocks(q, k.shape[1], axis.size, axis.index, op)
        out, lse = blocks.start()
        for j, kv in enumerate(_gather_kv(k, v, axis)):
            blocks.forward(out, lse, j, kv)
        ctx.axis, ctx.op, ctx.aux = axis, op, blocks.aux
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, lse, axis, blocks, dog, extra, dq = _backward_start(ctx, grad)
        gathered = _gather_kv(k, v, axis)  # again: only the local K/V were saved
        dkv = torch.zeros(gathered.shape, dtype=blocks.dt, device=k.device)
        for j, kv in enumerate(gathered):
            cols, bk, bv = blocks.backward(dq, j, kv, dog, lse, extra)
            dkv[j, 0, :, :, cols] = bk
            dkv[j, 1, :, :, cols] = bv
        mine = axis.reduce_scatter(dkv)[0]
        return dq.reshape(q.shape).to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


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
    to_global = torch.argsort(order)  # global position p sits at rank-order index to_global[p]
    split = [hq // cp, hkv // cp, hkv // cp]
    # [b, h, s, d] -> [cp, b, h/cp, s, d]: head shard r of this rank's tokens goes to rank r
    packed = torch.cat([t.reshape(b, cp, t.shape[1] // cp, s_local, d) for t in (q, k, v)], dim=2).movedim(1, 0)
    mine = _AllToAll.apply(packed, axis)  # [cp (source rank), b, H/cp, s_local, d]
    whole = mine.permute(1, 2, 0, 3, 4).reshape(b, sum(split), seq, d)[:, :, to_global]
    qh, kh, vh = whole.split(split, dim=1)
    if recompute and torch.is_grad_enabled():
        out = checkpoint(attention_core, qh, kh, vh, kernel, use_reentrant=False)
    else:
        out = attention_core(qh, kh, vh, kernel)
    back = out[:, :, order].reshape(b, hq // cp, cp, s_local, d).permute(2, 0, 1, 3, 4)
    return _AllToAll.apply(back, axis).movedim(0, 1).reshape(b, hq, s_local, d)


# ---------------------------------------------------------------- entry


def block_op(kernel, q):
    """The op ring/allgather blocks run for the layout's attention function `kernel` on q's device:
    None for naive's math, else lse_attention's adapter (ValueError where there is none)."""
    from harness.model.kernels import attention_fn

    if kernel is None or kernel is attention_fn("naive"):
        return None
    name = next((n for n in LSE_KERNELS if attention_fn(n) is kernel), None)
    if name is None:
        raise ValueError("ring and allgather blocks compute naive's math or torch's attention ops that return the LSE")
    return lse_op(name, q)


def attention(q, k, v, axis: Axis, impl: str, kernel=None, recompute: bool = False):
    """The rank's attention output [b, hq, s_local, d] (see the module docstring). kernel: the
    layout's attention function (ulysses runs it; ring and allgather run block_op's op for it)."""
    if axis.size == 1:
        from harness.model.kernels import attention_naive

        return attention_core(q, k, v, kernel or attention_naive)
    if impl in ("ring", "allgather"):
        return (_Ring if impl == "ring" else _AllGather).apply(q, k, v, axis, block_op(kernel, q))
    if impl == "ulysses":
        if kernel is None:
            raise ValueError("ulysses runs the layout's attention kernel: pass kernel=")
        return _ulysses(q, k, v, axis, kernel, recompute)
    raise NotImplementedError(f"cp_impl {impl!r}")
