"""Closed-form communication per training step: what the engine must send, by axis and op.

Pure functions of the model shape and the layout (no processes), so the planner can price a
layout before running it, and a test checks them exactly against the counters the engine
records (comm.CommStats). Conventions are comm.py's: bytes are this rank's payload per call
(all-reduce and p2p: the tensor; all-gather: the gathered tensor; reduce-scatter: its input).

Every entry also says its bytes by dtype ("bytes_by_dtype": {"fp32": n, "bf16": m}), from the
precision policy (harness.model.training.PrecisionPolicy): activations, their gradients and the
parameters are in the compute dtype (bf16 under precision bf16), the main gradients in
grad_accum_dtype, the DP reduction in grad_reduce_dtype; the loss's reductions are fp32.

Per micro-batch, with A = seq x micro_batch x hidden x (2 under bf16, 4 under fp32) bytes:
  TP without SP (axis tp): embedding 1 all-reduce fwd; per layer 2 all-reduces fwd (wo, w2)
      and 2 bwd (before wq/wk/wv and w1/w3); LM head 1 all-reduce bwd; full checkpointing
      repeats the attention's forward all-reduce (recomputation stops before the MLP's).
  TP with SP (axis sp): each of those all-reduces becomes an all-gather + reduce-scatter pair
      (fwd gather/bwd scatter on entering a region, fwd scatter/bwd gather on leaving it);
      full checkpointing recomputes a layer's forward up to its last saved tensor: both
      enters (SP all-gathers) and the attention's leave, not the MLP's leave.
      plus one all-reduce per step of the norm-weight gradients (their own bucket, in the
      main gradients' dtype, grad_accum_dtype).
  Vocab-parallel loss (axis tp): 2 fp32 all-reduces fwd on the last stage (row max: seq x mb
      floats; target logit and sum of exponentials: 2 x seq x mb floats).
  PP (axis pp): per chunk one send and one recv of A (A / tp under SP) per micro-batch and
      direction at every stage boundary it touches.
  DP (axis dp): once per step per gradient bucket (buckets padded to a multiple of dp): an
      all-reduce in grad_reduce_dtype, or under ZeRO-1 a reduce-scatter in grad_reduce_dtype
      and an all-gather of the updated parameters in their (compute) dtype.
  all: one all-reduce of two fp32 numbers (loss, squared gradient norm).
"""

from __future__ import annotations

from collections import defaultdict

from harness.engine.comm import comm_dict, comm_entry
from harness.engine.data_parallel import plan_buckets
from harness.engine.partition import rank_chunks, rank_params
from harness.model.presets import Shape
from harness.parallel_dims import ParallelDims

SIZE = {"fp32": 4, "bf16": 2}


def _add(out, axis, op, count, elems, dtype):
    if count:
        e = out[axis][op]
        e[0] += count
        e[1] += count * elems * SIZE[dtype]
        e[2][dtype] += count * elems * SIZE[dtype]


def rank_comm(shape: Shape, layout, seq_len: int, global_batch: int, rank: int, precision: str = "fp32",
              grad_accum_dtype: str = "fp32", grad_reduce_dtype: str = "fp32") -> dict:
    """Expected {axis: {op: {count, bytes, bytes_by_dtype}}} for one step on one rank, under the
    precision policy named by `precision` and the workload's grad_accum_dtype/grad_reduce_dtype
    (both fp32 under precision fp32)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    dims = ParallelDims.of(layout)
    c = dims.coord(rank)
    sp = layout.sequence_parallel and tp > 1
    chunks = layout.virtual_stages if layout.pipeline_schedule == "interleaved" else 1
    mb = layout.micro_batch_size
    micro = global_batch // (dp * mb)
    act, adt = seq_len * mb * shape.hidden, precision   # elements and dtype of an activation
    out = defaultdict(lambda: defaultdict(comm_entry))
    full_ckpt = layout.activation_checkpointing == "full"
    stages = pp * chunks
    for plan in rank_chunks(shape, pp, chunks, c.pp, seq_len):
        n = len(plan.layers)
        if tp > 1:
            regions = 2 * n              # attention and MLP: one enter and one leave each
            fwd_leave = regions + (1 if plan.first else 0)   # the embedding's leave too
            bwd_enter = regions + (1 if plan.last else 0)    # the head's enter too
            # full checkpointing recomputes both enters but, stopping early, only the first leave
            redo_enter, redo_leave = (2 * n, n) if full_ckpt else (0, 0)
            if sp:
                _add(out, "sp", "reduce_scatter", micro * (fwd_leave + bwd_enter + redo_leave), act, adt)
                _add(out, "sp", "all_gather", micro * (fwd_leave + bwd_enter + redo_enter), act, adt)
            else:
                _add(out, "tp", "all_reduce", micro * (fwd_leave + bwd_enter + redo_leave), act, adt)
            if plan.last:
                _add(out, "tp", "all_reduce", micro, seq_len * mb, "fp32")
                _add(out, "tp", "all_reduce", micro, 2 * seq_len * mb, "fp32")
        if pp > 1:
            p2p = act // tp if sp else act
            if plan.stage > 0:
                _add(out, "pp", "recv", micro, p2p, adt)
                _add(out, "pp", "send", micro, p2p, adt)
            if plan.stage < stages - 1:
                _add(out, "pp", "send", micro, p2p, adt)
                _add(out, "pp", "recv", micro, p2p, adt)
    specs = rank_params(shape, tp, pp, chunks, c.pp, seq_len)
    buckets = plan_buckets(specs, max(1, int(layout.dp_bucket_mb * 2 ** 20 / 4)), dp, sp)
    for b in buckets:
        if b["sp"]:
            _add(out, "sp", "all_reduce", 1, b["padded"], grad_accum_dtype)
        if dp > 1:
            if layout.zero_stage == 1:
                _add(out, "dp", "reduce_scatter", 1, b["padded"], grad_reduce_dtype)
                _add(out, "dp", "all_gather", 1, b["padded"], precision)
            else:
                _add(out, "dp", "all_reduce", 1, b["padded"], grad_reduce_dtype)
    if dims.world > 1:
        _add(out, "all", "all_reduce", 1, 2, "fp32")
    return comm_dict(out)


def world_comm(shape: Shape, layout, seq_len: int, global_batch: int, precision: str = "fp32",
               grad_accum_dtype: str = "fp32", grad_reduce_dtype: str = "fp32") -> dict:
    """Per-step totals over all ranks (what the planner prices), {axis: {op: {count, bytes, bytes_by_dtype}}}."""
    tot = defaultdict(lambda: defaultdict(comm_entry))
    for r in range(ParallelDims.of(layout).world):
        for axis, ops in rank_comm(shape, layout, seq_len, global_batch, r, precision, grad_accum_dtype,
                                   grad_reduce_dtype).items():
            for op, v in ops.items():
                e = tot[axis][op]
                e[0] += v["count"]
                e[1] += v["bytes"]
                for dtype, size in v["bytes_by_dtype"].items():
                    e[2][dtype] += size
    return comm_dict(tot)
