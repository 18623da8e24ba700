"""The own engine's ring/allgather blocks of every cp rank, computed in one process: what cp ranks compute
(harness/engine/context_parallel.py's _Blocks), without the exchange. It checks the block ops on a device
where the ranks cannot run (one GPU: NCCL takes one rank per GPU; scripts/gpu_variants.py) and, on CPU,
the block structure in the quick tier (tests/test_lse_attention.py)."""

from __future__ import annotations

import torch


def blockwise_attention(q, k, v, grad, cp: int, kernel: str):
    """(out, dq, dk, dv) in global token order for q [b, hq, s, d], k and v [b, hkv, s, d] (after rotary)
    and the output gradient `grad`, as cp ranks holding their cp_token_index chunks compute them: rank
    i's queries against every rank j's K/V block merged by log-sum-exp, each block's backward given the
    merged output and LSE, the dK/dV of every rank's queries summed at the block's owner."""
    from harness.engine.context_parallel import _Blocks, _pack, block_op
    from harness.model.kernels import attention_fn
    from harness.model.llama import cp_token_index

    s = q.shape[2]
    index = [cp_token_index(s, cp, r, q.device) for r in range(cp)]
    kvs = [_pack(k[:, :, ix], v[:, :, ix]) for ix in index]
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dkv = None
    for i, ix in enumerate(index):
        qi = q[:, :, ix].contiguous()
        blocks = _Blocks(qi, k.shape[1], cp, i, block_op(attention_fn(kernel), qi))
        merged, lse = blocks.start()
        for j in range(cp):
            blocks.forward(merged, lse, j, kvs[j])
        out[:, :, ix] = merged.reshape(qi.shape).to(q.dtype)
        dog, extra = blocks.backward_setup(grad[:, :, ix], merged)
        dqi = torch.zeros(blocks.qg.shape, dtype=blocks.dt, device=q.device)
        if dkv is None:
            dkv = torch.zeros((2, *k.shape), dtype=blocks.dt, device=k.device)
        for j in range(cp):
            cols, bk, bv = blocks.backward(dqi, j, kvs[j], dog, lse, extra)
            at = index[j][cols]
            dkv[0][:, :, at] += bk
            dkv[1][:, :, at] += bv
        dq[:, :, ix] = dqi.reshape(qi.shape).to(q.dtype)
    return out, dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype)
