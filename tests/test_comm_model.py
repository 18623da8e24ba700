"""The closed-form comm model and the partition it builds on, without processes.

(The distributed equivalence tests check the model exactly against measured counters on tiny
layouts; these check it on real shapes, where it is used for planning.)
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from harness.engine.comm import comm_dict, comm_entry
from harness.engine.comm_model import rank_comm
from harness.engine.data_parallel import plan_buckets
from harness.engine.model import rank_params
from harness.engine.parallel import ParallelContext
from harness.engine.partition import balanced_partition, rank_chunks
from harness.engine.schedules import Placement
from harness.model.presets import PRESETS, Shape, param_count
from harness.parallel_dims import ParallelDims
from harness.spec import Layout


def world_comm(
    shape: Shape,
    layout,
    seq_len: int,
    global_batch: int,
    precision: str = "fp32",
    grad_accum_dtype: str = "fp32",
    grad_reduce_dtype: str = "fp32",
) -> dict:
    """Per-step totals over all ranks, {axis: {op: {count, bytes, bytes_by_dtype}}}: rank_comm summed."""
    tot = defaultdict(lambda: defaultdict(comm_entry))
    for r in range(ParallelDims.of(layout).world):
        for axis, ops in rank_comm(
            shape, layout, seq_len, global_batch, r, precision, grad_accum_dtype, grad_reduce_dtype
        ).items():
            for op, v in ops.items():
                e = tot[axis][op]
                e[0] += v["count"]
                e[1] += v["bytes"]
                for dtype, size in v["bytes_by_dtype"].items():
                    e[2][dtype] += size
    return comm_dict(tot)


def _numel(s):
    return math.prod(s.local)


def _rank_params(shape, tp: int, pp: int, chunks: int, pp_rank: int, seq_len: int):
    """The parameter list of pipeline rank pp_rank's tp index 0 (its chunks built on the meta device)."""
    dims = ParallelDims(tp=tp, pp=pp)
    plans = rank_chunks(shape, Placement(pp, chunks), pp_rank, seq_len)
    return rank_params(shape, plans, ParallelContext.unconnected(dims, dims.rank(pp=pp_rank)))


@pytest.mark.parametrize(
    "name,tp,pp,chunks", [("llama-13b", 8, 4, 1), ("paper-30b", 4, 6, 2), ("llama2-70b", 8, 8, 1), ("tiny", 2, 2, 1)]
)
def test_shards_add_up_to_the_model(name, tp, pp, chunks):
    shape = PRESETS[name]
    total = 0
    for r in range(pp):
        for s in _rank_params(shape, tp, pp, chunks, r, 2048):
            total += _numel(s) * (tp if s.shard_dim is not None else 1)
    assert total == param_count(shape)
    parts = balanced_partition(shape, pp * chunks, 2048)
    assert [i for p in parts for i in p] == list(range(shape.layers))


def test_last_stage_gets_fewer_layers_with_a_large_vocabulary():
    parts = balanced_partition(PRESETS["paper-13b"], 8, 2048)
    assert len(parts[-1]) < len(parts[0])


def test_13b_tp8_sp_counts_by_hand():
    shape = PRESETS["llama-13b"]
    lay = Layout(engine="own", tp=8, pp=4, dp=16, micro_batch_size=1, sequence_parallel=True, zero_stage=1)
    seq, gbs = 2048, 256
    micro = gbs // 16
    act = seq * 1 * shape.hidden * 4
    first = rank_comm(shape, lay, seq, gbs, 0)
    layers = len(balanced_partition(shape, 4, seq)[0])
    # per micro-batch: 2 regions per layer, each one all-gather and one reduce-scatter per pass,
    # plus the embedding's reduce-scatter (fwd) / all-gather (bwd)
    n = micro * (4 * layers + 1)
    assert first["sp"]["all_gather"] == {"count": n, "bytes": n * act, "bytes_by_dtype": {"fp32": n * act}}
    assert first["sp"]["reduce_scatter"]["count"] == micro * (4 * layers + 1)
    assert "tp" not in first  # no loss on the first stage, no all-reduce under SP
    assert first["pp"]["send"] == {
        "count": micro,
        "bytes": micro * act // 8,
        "bytes_by_dtype": {"fp32": micro * act // 8},
    }
    last = rank_comm(shape, lay, seq, gbs, 8 * 16 * 3)
    loss = micro * (seq * 4 + 2 * seq * 4)
    assert last["tp"]["all_reduce"] == {"count": 2 * micro, "bytes": loss, "bytes_by_dtype": {"fp32": loss}}
    # ZeRO-1 moves each local parameter twice (reduce-scatter + all-gather), padded to dp
    local = sum(_numel(s) for s in _rank_params(shape, 8, 4, 1, 0, seq))
    rs = first["dp"]["reduce_scatter"]["bytes"]
    assert local * 4 <= rs < local * 4 + 16 * 4 * first["dp"]["reduce_scatter"]["count"]
    assert first["dp"]["all_gather"]["bytes"] == rs


def test_world_totals_scale_with_dp_for_data_parallel_traffic():
    shape = PRESETS["tiny-4l"]
    one = world_comm(shape, Layout(engine="own", tp=2, pp=2, dp=2), 128, 16)
    two = world_comm(shape, Layout(engine="own", tp=2, pp=2, dp=4), 128, 16)
    # same global batch: TP traffic is the same in total, DP collectives double in count
    assert one["tp"]["all_reduce"]["bytes"] == two["tp"]["all_reduce"]["bytes"]
    assert two["dp"]["all_reduce"]["count"] == 2 * one["dp"]["all_reduce"]["count"]


@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_bf16_halves_activations_and_follows_the_policy_for_gradients(reduce):
    """Under bf16 the activations (TP/SP regions, pipeline) and the ZeRO-1 all-gather of the
    parameters move bf16; the loss's reductions and the world all-reduce stay fp32; the DP
    reduction is in grad_reduce_dtype and the SP norm-gradient all-reduce in grad_accum_dtype."""
    shape = PRESETS["tiny-4l"]
    lay = Layout(engine="own", tp=2, pp=2, dp=2, sequence_parallel=True, zero_stage=1)
    fp32 = rank_comm(shape, lay, 128, 16, 7)  # the last stage: loss reductions too
    bf16 = rank_comm(shape, lay, 128, 16, 7, "bf16", "fp32", reduce)
    for op in ("all_gather", "reduce_scatter"):
        assert bf16["sp"][op]["bytes_by_dtype"] == {"bf16": fp32["sp"][op]["bytes"] // 2}
    for op in ("send", "recv"):
        assert bf16["pp"][op]["bytes_by_dtype"] == {"bf16": fp32["pp"][op]["bytes"] // 2}
    assert bf16["tp"] == fp32["tp"] and bf16["all"] == fp32["all"]  # loss and norm: fp32
    assert bf16["sp"]["all_reduce"] == fp32["sp"]["all_reduce"]  # norm gradients, fp32 main gradients
    rs = fp32["dp"]["reduce_scatter"]["bytes"]
    assert bf16["dp"]["reduce_scatter"]["bytes_by_dtype"] == {reduce: rs // (2 if reduce == "bf16" else 1)}
    assert bf16["dp"]["all_gather"]["bytes_by_dtype"] == {"bf16": rs // 2}
    for ops in bf16.values():
        for v in ops.values():
            assert v["bytes"] == sum(v["bytes_by_dtype"].values())


def test_cp_halves_each_ranks_activation_traffic_and_reduces_gradients_over_dp_x_cp():
    """cp2 on the same layout: every rank's activations hold seq/2 tokens (SP and PP bytes halve, same
    counts), the gradient buckets are reduced over the dp x cp replicas (padded to a multiple of 4,
    not 2), and the world moves as many ZeRO-1 collectives again as it has ranks again."""
    shape = PRESETS["tiny-4l"]
    base = dict(engine="own", tp=2, pp=2, dp=2, sequence_parallel=True, zero_stage=1, dp_bucket_mb=0.05)
    one, two = Layout(**base), Layout(**base, cp=2, cp_impl="ring", attention="naive")
    r1, r2 = rank_comm(shape, one, 128, 16, 0), rank_comm(shape, two, 128, 16, 0)
    for axis, op in (("sp", "all_gather"), ("sp", "reduce_scatter"), ("pp", "send"), ("pp", "recv")):
        assert r2[axis][op]["count"] == r1[axis][op]["count"] and r2[axis][op]["bytes"] * 2 == r1[axis][op]["bytes"]
    specs = _rank_params(shape, 2, 2, 1, 0, 128)
    padded = [b["padded"] for b in plan_buckets(specs, int(0.05 * 2**20 / 4), 4, True)]
    assert all(p % 4 == 0 for p in padded)
    assert r2["dp"]["reduce_scatter"] == {
        "count": len(padded),
        "bytes": 4 * sum(padded),
        "bytes_by_dtype": {"fp32": 4 * sum(padded)},
    }
    assert set(r2["cp"]) == {"send", "recv"} and "cp" not in r1
    w1, w2 = world_comm(shape, one, 128, 16), world_comm(shape, two, 128, 16)
    assert w2["dp"]["reduce_scatter"]["count"] == 2 * w1["dp"]["reduce_scatter"]["count"]
