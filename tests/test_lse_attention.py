"""The op adapters ring and allgather blocks run (harness/engine/lse_attention.py), on this CPU, against
plain fp64 attention math: a block's output and log-sum-exp, and the gradients its backward gives
when handed the merged output and LSE of a row split over two key blocks (what context_parallel does).

Tolerances: fp64 inputs run the CPU flash kernel in fp64, so what differs from the fp64 math is
rounding of O(s·d) terms at 1e-16 each: 1e-10 bounds it with room. fp32 inputs: each output is a
convex combination of V rows, accumulated over s ≤ 16 keys and d = 16 products per score, rounding
1e-7 relative each: 1e-5 absolute on unit-scale data. Gradients at 10x those bounds: each is a
sum over both blocks (12 keys, or the 8 query rows) of products of two such rounded terms (P and
dP - delta), up to an order of magnitude larger than one output on unit-scale data. The CUDA
adapters have the same interface and run on a GPU only (scripts/gpu_engines.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.engine.lse_attention import LSE_KERNELS, OPS, lse_op


def _math(q, k, v, causal):
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _qkv(dtype, sq=8, sk=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, n, 16, generator=g, dtype=torch.float64).to(dtype) for n in (sq, sk, sk)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kernel", ["sdpa", "sdpa_flash"])
@pytest.mark.parametrize("causal,sq,sk", [(True, 8, 8), (False, 8, 4), (False, 4, 8)])
def test_a_block_is_attention_math_with_its_lse(dtype, kernel, causal, sq, sk):
    """The diagonal block (is_causal) and the off-diagonal half-blocks (no mask; queries or keys cut)."""
    q, k, v = _qkv(dtype, sq, sk)
    out, lse, _ = lse_op(kernel, q).forward(q, k, v, causal)
    want_out, want_lse = _math(q, k, v, causal)
    assert out.dtype == dtype and lse.shape == (2, 4, sq)
    assert (out.double() - want_out).abs().max() <= TOL[dtype]
    assert (lse.double() - want_lse).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_backward_with_the_merged_lse_gives_the_whole_rows_gradients(dtype):
    """Keys split into a causal diagonal block and a full earlier block, as a ring rank sees them:
    forward each, merge by log-sum-exp, run each block's backward with the merged output and LSE;
    dq summed over blocks and each block's dk, dv equal autograd through the whole row's math."""
    q, k_diag, v_diag = _qkv(dtype, 8, 8, seed=1)
    _, k_prev, v_prev = _qkv(dtype, 8, 4, seed=2)
    dout = _qkv(dtype, 8, 8, seed=3)[0]
    op = lse_op("sdpa_flash", q)
    blocks = [(k_prev, v_prev, False), (k_diag, v_diag, True)]
    outs = [op.forward(q, k, v, c) for k, v, c in blocks]
    lse = torch.logsumexp(torch.stack([o[1].double() for o in outs]), 0)
    out = sum(o[0].double() * torch.exp(o[1].double() - lse).unsqueeze(-1) for o in outs).to(dtype)
    grads = [op.backward(dout, q, k, v, out, lse, c, o[2]) for (k, v, c), o in zip(blocks, outs, strict=True)]

    leaves = [t.double().requires_grad_() for t in (q, k_prev, v_prev, k_diag, v_diag)]
    qd, kp, vp, kd, vd = leaves
    s = qd @ torch.cat([kp, kd], 2).transpose(-1, -2) / 4.0
    mask = torch.zeros(8, 12, dtype=torch.bool)
    mask[:, 4:] = torch.ones(8, 8, dtype=torch.bool).triu(1)
    want = torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ torch.cat([vp, vd], 2)
    want.backward(dout.double())
    assert (out.double() - want).abs().max() <= TOL[dtype]
    got = [grads[0][0].double() + grads[1][0].double(), *grads[0][1:], *grads[1][1:]]
    for g, leaf in zip(got, leaves, strict=True):
        assert (g.double() - leaf.grad).abs().max() <= 10 * TOL[dtype]


def test_every_kernel_has_an_op_on_cuda_and_only_flash_on_cpu():
    assert {k for k, d in OPS if d == "cuda"} == set(LSE_KERNELS) - {"sdpa"}
    assert {k for k, d in OPS if d == "cpu"} == {"sdpa_flash"}
    q = torch.zeros(1, 1, 2, 8)
    for kernel in ("sdpa_efficient", "sdpa_cudnn"):
        with pytest.raises(ValueError, match="on cpu"):
            lse_op(kernel, q)


def test_ring_and_allgather_blocks_run_naive_math_or_an_lse_op():
    from harness.engine.context_parallel import block_op
    from harness.model.kernels import attention_fn

    q = torch.zeros(1, 1, 2, 8)
    assert block_op(None, q) is None and block_op(attention_fn("naive"), q) is None
    assert block_op(attention_fn("sdpa"), q) is block_op(attention_fn("sdpa_flash"), q) is OPS[("sdpa_flash", "cpu")]
    with pytest.raises(ValueError):
        block_op(attention_fn("flash2"), q)
    with pytest.raises(ValueError, match="on cpu"):
        block_op(attention_fn("sdpa_efficient"), q)


@pytest.mark.parametrize(
    "kernel,dtype,cp", [("naive", torch.float64, 2), ("sdpa_flash", torch.float32, 2), ("sdpa", torch.float64, 4)]
)
def test_every_ranks_blocks_in_one_process_are_the_whole_sequences_attention(kernel, dtype, cp):
    """The ring's block structure (diagonal causal, earlier ranks' first chunks, later ranks' keys for the
    second chunk) over all cp ranks, no process: output and q/k/v gradients equal the single-device
    attention core with the same kernel (GQA: 4 query heads over 2 KV heads). Tolerance 1e-5: the
    fp32 bound above; fp64 cases are held to it too (the naive reference computes in fp32)."""
    from harness.model.kernels import attention_fn
    from harness.model.llama import attention_core
    from harness.testing.cp_blocks import blockwise_attention

    g = torch.Generator().manual_seed(cp)
    q, k, v, grad = (torch.randn(2, h, 8 * cp, 8, generator=g, dtype=torch.float64).to(dtype) for h in (4, 2, 2, 4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention_core(*leaves, attention_fn(kernel))
    want.backward(grad)
    got = blockwise_attention(q, k, v, grad, cp, kernel)
    for a, b in zip(got, [want] + [t.grad for t in leaves], strict=True):
        assert a.dtype == dtype and (a.double() - b.double()).abs().max() <= 1e-5


@pytest.mark.parametrize("kernel", ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn"])
@pytest.mark.parametrize("causal,sq,sk", [(True, 48, 48), (False, 24, 48), (False, 48, 24)])
def test_the_cuda_adapters_call_their_ops_as_torch_declares_them(kernel, causal, sq, sk):
    """No GPU here: on meta tensors (torch's meta kernels of the same ops) each CUDA adapter's forward and
    backward take the arguments in the ops' schema order and give [b, h, sq] LSE (efficient's padding cut,
    cuDNN's trailing 1 dropped) and gradients of the inputs' shapes. Their numbers: scripts/gpu_variants.py."""
    op = OPS[(kernel, "cuda")]
    q = torch.empty(2, 4, sq, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 4, sk, 64, device="meta", dtype=torch.bfloat16)
    out, lse, aux = op.forward(q, k, k, causal)
    assert out.shape == q.shape and lse.shape == (2, 4, sq)
    grads = op.backward(out, q, k, k, out, torch.empty(2, 4, sq, device="meta"), causal, aux)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]
