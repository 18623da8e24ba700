"""The own engine's context-parallel attention (harness/engine/context_parallel.py) against the
single-device attention core, and its counted communication against comm_model's closed form.

Function level: the same q, k, v (GQA: 4 query heads, 2 KV heads) through attention_core on one
rank and through `attention` on the cp ranks holding their load-balanced chunks; outputs and q/k/v
gradients must agree. The naive reference computes in fp32 whatever its inputs, so the fp64 cases
feed fp64 inputs (the CP side then computes in fp64) and still compare at 1e-5: what is left is the
reference's fp32 rounding. One 2-rank and one 4-rank launch run every case.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch

from harness.engine.comm import comm_dict, comm_entry
from harness.engine.comm_model import SIZE, cp_attention_calls, rank_comm
from harness.model.presets import PRESETS
from harness.spec import Layout
from harness.testing.launches import shared_launch

B, HQ, HKV, D = 2, 4, 2, 8
TOL = {torch.float64: (1e-5, 1e-5), torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}
NAME = {torch.float64: "float64", torch.float32: "fp32", torch.bfloat16: "bf16"}  # as comm.py names them
SIZE_OF = {**SIZE, "float64": 8}

# (impl, dtype, kernel, checkpointing): checkpointing none | selective (recompute=True) | full (the
# call under torch's non-reentrant checkpoint, as a block re-run)
CASES2 = [
    ("ring", torch.float64, "naive", "none"),
    ("allgather", torch.float64, "naive", "none"),
    ("ulysses", torch.float64, "naive", "none"),
    ("ulysses", torch.float32, "sdpa", "none"),
    ("ring", torch.float32, "naive", "none"),
    ("ring", torch.bfloat16, "naive", "none"),
    ("allgather", torch.bfloat16, "naive", "none"),
    ("ulysses", torch.bfloat16, "sdpa", "none"),
    ("ring", torch.float64, "naive", "full"),
    ("ring", torch.float64, "naive", "selective"),
    ("allgather", torch.float64, "naive", "full"),
    ("ulysses", torch.float32, "sdpa", "full"),
    ("ulysses", torch.float32, "sdpa", "selective"),
    ("ring", torch.float32, "sdpa", "none"),
    ("ring", torch.bfloat16, "sdpa", "none"),
    ("allgather", torch.float32, "sdpa", "none"),
    ("ring", torch.float64, "sdpa", "full"),
    ("ring", torch.float32, "sdpa_flash", "none"),  # the same CPU flash op, named
    ("allgather", torch.float32, "sdpa_flash", "none"),
]
CASES4 = [
    ("ring", torch.float64, "naive", "none"),
    ("ring", torch.float32, "naive", "none"),
    ("ring", torch.bfloat16, "naive", "none"),
    ("allgather", torch.float64, "naive", "none"),
    ("ring", torch.float64, "naive", "full"),
    ("ring", torch.float32, "sdpa", "none"),
]


def _excess(got, want, dtype):
    """max(|got - want| - (atol + rtol |want|)): <= 0 where the two agree."""
    atol, rtol = TOL[dtype]
    return ((got.double() - want.double()).abs() - atol - rtol * want.double().abs()).max().item()


def _consumed(out):
    return out + 0 * out.sin()


def _cases(ctx, cases, seq):
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from harness.engine.comm import Axis, CommStats, StepClock
    from harness.engine.context_parallel import attention
    from harness.model.kernels import attention_fn
    from harness.model.llama import attention_core, cp_token_index

    start = time.perf_counter()
    world, rank = ctx.world_size, ctx.rank
    axis = Axis("cp", dist.group.WORLD, list(range(world)), rank, CommStats(StepClock(torch.device("cpu"))), "cp")
    out = []
    for impl, dtype, kname, ckpt in cases:
        kernel = attention_fn(kname)
        g = torch.Generator().manual_seed(len(out))
        q, k, v, go = (
            torch.randn(B, h, seq, D, generator=g, dtype=torch.float64).to(dtype) for h in (HQ, HKV, HKV, HQ)
        )
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = attention_core(*full, kernel)
        ref.backward(go)
        idx = cp_token_index(seq, world, rank)
        mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        axis.stats.reset()
        if ckpt == "full":  # 0·sin(out) keeps out saved, as the block's wo does: the whole forward re-runs
            got = checkpoint(
                lambda *t, impl=impl, kernel=kernel: _consumed(attention(*t, axis, impl, kernel)),
                *mine,
                use_reentrant=False,
            )
        else:
            got = attention(*mine, axis, impl, kernel=kernel, recompute=ckpt == "selective")
        got.backward(go[:, :, idx])
        excess = {"out": _excess(got, ref[:, :, idx], dtype)}
        for name, m, f in zip("qkv", mine, full, strict=True):
            excess["d" + name] = _excess(m.grad, f.grad[:, :, idx], dtype)
        out.append({"excess": excess, "dtype": got.dtype == dtype, "comm": axis.stats.as_dict()})
    return {"cases": out, "seconds": time.perf_counter() - start}


def _expected(impl, cp, seq, dtype, ckpt):
    e = defaultdict(lambda: defaultdict(comm_entry))
    for op, count, elems, dt in cp_attention_calls(
        impl, cp, B, HQ, HKV, seq // cp, D, NAME[dtype], 2 if ckpt == "full" else 1
    ):
        dt = "float64" if dtype == torch.float64 else dt  # fp64 inputs: the core and its gradients in fp64
        entry = e["cp"][op]
        entry[0] += count
        entry[1] += count * elems * SIZE_OF[dt]
        entry[2][dt] += count * elems * SIZE_OF[dt]
    return comm_dict(e)


two = shared_launch("torch", 2, _cases, CASES2, 16, timeout_s=120, every_rank=True)
four = shared_launch("torch", 4, _cases, CASES4, 32, timeout_s=120, every_rank=True)


def _check(results, cases, index, cp, seq):
    impl, dtype, _, ckpt = cases[index]
    for rank, per_rank in enumerate(results):
        r = per_rank["cases"][index]
        assert r["dtype"]
        assert all(x <= 0 for x in r["excess"].values()), (rank, r["excess"])
        assert r["comm"] == _expected(impl, cp, seq, dtype, ckpt), rank


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(CASES2)), ids=["-".join(map(str, c[:1] + (NAME[c[1]],) + c[2:])) for c in CASES2]
)
def test_cp2_matches_the_single_device_attention_and_the_closed_form(two, index):
    _check(two, CASES2, index, 2, 16)


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(CASES4)), ids=["-".join(map(str, c[:1] + (NAME[c[1]],) + c[2:])) for c in CASES4]
)
def test_cp4_matches_the_single_device_attention_and_the_closed_form(four, index):
    _check(four, CASES4, index, 4, 32)


# ---------------------------------------------------------------- the closed form's structure (no processes)


def _ops(calls):
    out = defaultdict(lambda: [0, 0])
    for op, count, elems, dt in calls:
        out[(op, dt)][0] += count
        out[(op, dt)][1] += count * elems
    return dict(out)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_sends_each_kv_block_round_the_ring_and_its_gradient_home(cp):
    kv = 2 * 1 * 8 * 512 * 128
    calls = _ops(cp_attention_calls("ring", cp, 1, 32, 8, 512, 128, "bf16"))
    assert calls[("send", "bf16")] == [2 * (cp - 1), 2 * (cp - 1) * kv]  # forward and backward hops
    assert calls[("send", "fp32")] == [cp, cp * kv]  # dK/dV: cp hops to get home
    assert calls[("send", "bf16")] == calls[("recv", "bf16")] and calls[("send", "fp32")] == calls[("recv", "fp32")]
    redo = _ops(cp_attention_calls("ring", cp, 1, 32, 8, 512, 128, "bf16", forward_runs=2))
    assert redo[("send", "bf16")][0] == 3 * (cp - 1)


def test_allgather_and_ulysses_calls():
    kv = 2 * 1 * 8 * 512 * 128
    assert _ops(cp_attention_calls("allgather", 4, 1, 32, 8, 512, 128, "fp32")) == {
        ("all_gather", "fp32"): [2, 2 * 4 * kv],
        ("reduce_scatter", "fp32"): [1, 4 * kv],
    }
    assert _ops(cp_attention_calls("ulysses", 4, 1, 32, 8, 512, 128, "bf16", forward_runs=2)) == {
        ("all_to_all", "bf16"): [6, 3 * (48 + 32) * 512 * 128]
    }
    assert cp_attention_calls("ring", 1, 1, 32, 8, 512, 128, "bf16") == []


def test_rank_comm_has_cp_terms_per_layer_and_micro_batch_and_dp_over_the_replicas():
    shape = PRESETS["tiny"]
    seq, gbs = 64, 8
    lay = Layout(engine="own", tp=2, cp=2, cp_impl="ring", dp=1, micro_batch_size=2)
    got = rank_comm(shape, lay, seq, gbs, 0)
    micro, tokens, hkv = gbs // 2, seq // 2, shape.kv_heads // 2
    kv = 2 * 2 * hkv * tokens * (shape.hidden // shape.heads) * 4
    n = micro * shape.layers
    assert got["cp"]["send"] == {"count": n * (2 + 2), "bytes": n * 4 * kv, "bytes_by_dtype": {"fp32": n * 4 * kv}}
    # the TP all-reduces carry the rank's seq/cp tokens; the gradients are reduced over dp x cp = 2
    tp_ar = rank_comm(shape, Layout(engine="own", tp=2, dp=1, micro_batch_size=2), seq, gbs, 0)["tp"]["all_reduce"]
    assert 2 * got["tp"]["all_reduce"]["bytes"] == tp_ar["bytes"]
    assert got["dp"]["all_reduce"]["count"] >= 1
    full = rank_comm(
        shape, Layout(engine="own", tp=2, cp=2, dp=1, micro_batch_size=2, activation_checkpointing="full"), seq, gbs, 0
    )
    assert full["cp"]["send"]["count"] == got["cp"]["send"]["count"] + n
    sel = rank_comm(
        shape,
        Layout(engine="own", tp=2, cp=2, dp=1, micro_batch_size=2, activation_checkpointing="selective"),
        seq,
        gbs,
        0,
    )
    assert sel["cp"] == got["cp"]
    bf16 = rank_comm(shape, lay, seq, gbs, 0, precision="bf16")["cp"]["send"]["bytes_by_dtype"]
    assert bf16 == {"bf16": n * 2 * kv // 2, "fp32": n * 2 * kv}
