"""torch's attention ops that return the log-sum-exp, one adapter per op: what the own engine's ring and
allgather context parallelism (context_parallel.py) computes each block with when the layout's kernel
is not naive.

Every adapter takes q, k, v as [b, h, s, d] (k, v already repeated to the query heads) and `causal`
(the diagonal block, square; every other block is full: context_parallel.py cuts the half-blocks by
slicing, so no mask is ever passed), and gives
  forward(q, k, v, causal) -> (out [b, h, sq, d] in q's dtype, lse [b, h, sq], aux)
  backward(dout, q, k, v, out, lse, causal, aux) -> (dq, dk, dv)
where backward is handed the merged output and LSE of the whole row (so its probabilities
exp(S - LSE) are the row's, and its delta = rowsum(dO·O) the merged one) and `aux` is what the
forward returned for the backward op (its RNG state, sequence bookkeeping): what autograd would
save for it. The ops, by device:
  cpu   flash      aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): what
                   F.scaled_dot_product_attention runs on CPU; LSE [b, h, s] in fp32 (fp64 inputs: fp64)
  cuda  flash      aten._scaled_dot_product_flash_attention (+ _backward); LSE [b, h, s] fp32
        efficient  aten._scaled_dot_product_efficient_attention(compute_log_sumexp=True) (+ _backward);
                   LSE [b, h, s padded to a multiple of 32] fp32: cut here, padded back for backward
        cudnn      aten._scaled_dot_product_cudnn_attention(compute_log_sumexp=True) (+ _backward);
                   LSE [b, h, s, 1] fp32: reshaped here and back
`sdpa` is whichever of these torch's own dispatcher picks for the inputs (torch._fused_sdp_choice,
as F.scaled_dot_product_attention does). Whether a kernel runs on the device at the run's dtype
and head size is checked before launch by harness.model.kernels.check_kernels, which runs the
same op through F.scaled_dot_product_attention with gradients (so with the LSE).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class LseOp:
    name: str
    forward: Callable
    backward: Callable


def _c(*ts):
    return [t.contiguous() for t in ts]


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _cpu_flash_fwd(q, k, v, causal):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(*_c(q, k, v), 0.0, causal)
    return out, lse, ()


def _cpu_flash_bwd(dout, q, k, v, out, lse, causal, aux):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        *_c(dout, q, k, v, out, lse.to(_lse_dtype(q))), 0.0, causal
    )


def _flash_fwd(q, k, v, causal):
    out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = aten._scaled_dot_product_flash_attention(
        *_c(q, k, v), 0.0, causal
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, rng, unused)


def _flash_bwd(dout, q, k, v, out, lse, causal, aux):
    cum_q, cum_k, max_q, max_k, rng, unused = aux
    return aten._scaled_dot_product_flash_attention_backward(
        *_c(dout, q, k, v, out, lse.float()), cum_q, cum_k, max_q, max_k, 0.0, causal, rng, unused
    )


def _efficient_fwd(q, k, v, causal):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(*_c(q, k, v), None, True, 0.0, causal)
    return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])


def _efficient_bwd(dout, q, k, v, out, lse, causal, aux):
    seed, offset, padded = aux
    lse = F.pad(lse.float(), (0, padded - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        *_c(dout, q, k, v), None, out.contiguous(), lse, seed, offset, 0.0, [True, True, True, False], causal
    )
    return dq, dk, dv


def _cudnn_fwd(q, k, v, causal):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        *_c(q, k, v), None, True, 0.0, causal
    )
    b, h, s = q.shape[:3]
    return out, lse.reshape(b, h, s), (seed, offset, cum_q, cum_k, max_q, max_k, tuple(lse.shape))


def _cudnn_bwd(dout, q, k, v, out, lse, causal, aux):
    seed, offset, cum_q, cum_k, max_q, max_k, shape = aux
    lse = lse.float().reshape(shape).contiguous()
    return aten._scaled_dot_product_cudnn_attention_backward(
        *_c(dout, q, k, v, out), lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal
    )


OPS = {  # (kernel, device type) -> adapter; sdpa is resolved by torch's choice (lse_op)
    ("sdpa_flash", "cpu"): LseOp("flash (cpu)", _cpu_flash_fwd, _cpu_flash_bwd),
    ("sdpa_flash", "cuda"): LseOp("flash", _flash_fwd, _flash_bwd),
    ("sdpa_efficient", "cuda"): LseOp("efficient", _efficient_fwd, _efficient_bwd),
    ("sdpa_cudnn", "cuda"): LseOp("cudnn", _cudnn_fwd, _cudnn_bwd),
}
LSE_KERNELS = ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")  # layout.attention values with an adapter
_CHOICE = {1: "sdpa_flash", 2: "sdpa_efficient", 3: "sdpa_cudnn"}  # torch.nn.attention.SDPBackend's values


def lse_op(kernel: str, q) -> LseOp:
    """The adapter for layout.attention `kernel` on q's device (q: [b, h, s, d], the diagonal block's
    queries, for sdpa's choice). ValueError where torch has no such op there."""
    device = q.device.type
    if kernel == "sdpa":
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
        if choice not in _CHOICE:
            raise ValueError(f"sdpa picks a kernel without a log-sum-exp on {device} (backend {choice})")
        kernel = _CHOICE[choice]
    op = OPS.get((kernel, device))
    if op is None:
        ops = ", ".join(k for k, d in OPS if d == device) or "none"
        raise ValueError(f"no {kernel} op that returns the log-sum-exp on {device} (there: {ops})")
    return op
