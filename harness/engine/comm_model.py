"""Closed-form communication per training step: what the engine must send, by axis and op.

Pure functions of the model shape and the layout (no processes), so the planner can price a
layout before running it, and a test checks them exactly against the counters the engine
records (comm.CommStats). Conventions are comm.py's: bytes are this rank's payload per call
(all-reduce and p2p: the tensor; all-gather: the gathered tensor; reduce-scatter: its input).

Per micro-batch, with A = seq x micro_batch x hidden x 4 bytes (fp32 activations):
  TP without SP (axis tp): embedding 1 all-reduce fwd; per layer 2 all-reduces fwd (wo, w2)
      and 2 bwd (before wq/wk/wv and w1/w3); LM head 1 all-reduce bwd; full checkpointing
      repeats the attention's forward all-reduce (recomputation stops before the MLP's).
  TP with SP (axis sp): each of those all-reduces becomes an all-gather + reduce-scatter pair
      (fwd gather/bwd scatter on entering a region, fwd scatter/bwd gather on leaving it);
      full checkpointing recomputes a layer's forward up to its last saved tensor: both
      enters (SP all-gathers) and the attention's leave, not the MLP's leave.
      plus one all-reduce per step of the norm-weight gradients (their own bucket).
  Vocab-parallel loss (axis tp): 2 all-reduces fwd on the last stage (row max: seq x mb
      floats; target logit and sum of exponentials: 2 x seq x mb floats).
  PP (axis pp): per chunk one send and one recv of A (A / tp under SP) per micro-batch and
      direction at every stage boundary it touches.
  DP (axis dp): once per step per gradient bucket: all-reduce, or reduce-scatter + all-gather
      under ZeRO-1 (buckets padded to a multiple of dp).
  all: one all-reduce of two fp32 numbers (loss, squared gradient norm).
"""

from __future__ import annotations

from collections import defaultdict

from harness.engine.data_parallel import plan_buckets
from harness.engine.partition import rank_chunks, rank_params
from harness.engine.topology import coord_of
from harness.model.presets import Shape


def _add(out, axis, op, count, size):
    if count:
        e = out[axis][op]
        e[0] += count
        e[1] += count * size


def rank_comm(shape: Shape, layout, seq_len: int, global_batch: int, rank: int, precision: str = "fp32") -> dict:
    """Expected {axis: {op: {count, bytes}}} for one step on one rank.

    Under bf16 (autocast over fp32 weights) the TP/SP region collectives carry bf16, except
    the embedding's (its rows are fp32 and feed the fp32 residual stream); the loss, pipeline
    and DP traffic stays fp32.
    """
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    c = coord_of(rank, tp, pp, dp)
    sp = layout.sequence_parallel and tp > 1
    chunks = layout.virtual_stages if layout.pipeline_schedule == "interleaved" else 1
    mb = layout.micro_batch_size
    micro = global_batch // (dp * mb)
    act = seq_len * mb * shape.hidden * 4
    region = act // 2 if precision == "bf16" else act
    out = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    full_ckpt = layout.activation_checkpointing == "full"
    stages = pp * chunks
    for plan in rank_chunks(shape, pp, chunks, c.pp, seq_len):
        n = len(plan.layers)
        if tp > 1:
            regions = 2 * n              # attention and MLP: one enter and one leave each
            fwd_leave = regions + (1 if plan.first else 0)
            bwd_enter = regions + (1 if plan.last else 0)
            # full checkpointing recomputes both enters but, stopping early, only the first leave
            redo_enter, redo_leave = (2 * n, n) if full_ckpt else (0, 0)
            emb = 1 if plan.first else 0      # the embedding's leave: fp32 forward and backward
            n_rs = fwd_leave + bwd_enter + redo_leave - emb
            n_ag = fwd_leave + bwd_enter + redo_enter - emb
            if sp:
                _add(out, "sp", "reduce_scatter", micro * n_rs, region)
                _add(out, "sp", "all_gather", micro * n_ag, region)
                _add(out, "sp", "reduce_scatter", micro * emb, act)
                _add(out, "sp", "all_gather", micro * emb, act)
            else:
                _add(out, "tp", "all_reduce", micro * (fwd_leave + bwd_enter + redo_leave - emb), region)
                _add(out, "tp", "all_reduce", micro * emb, act)
            if plan.last:
                _add(out, "tp", "all_reduce", micro, seq_len * mb * 4)
                _add(out, "tp", "all_reduce", micro, 2 * seq_len * mb * 4)
        if pp > 1:
            p2p = act // tp if sp else act
            if plan.stage > 0:
                _add(out, "pp", "recv", micro, p2p)
                _add(out, "pp", "send", micro, p2p)
            if plan.stage < stages - 1:
                _add(out, "pp", "send", micro, p2p)
                _add(out, "pp", "recv", micro, p2p)
    specs = rank_params(shape, tp, pp, chunks, c.pp, seq_len)
    buckets = plan_buckets(specs, max(1, int(layout.dp_bucket_mb * 2 ** 20 / 4)), dp, sp)
    for b in buckets:
        size = b["padded"] * 4
        if b["sp"]:
            _add(out, "sp", "all_reduce", 1, size)
        if dp > 1:
            if layout.zero_stage == 1:
                _add(out, "dp", "reduce_scatter", 1, size)
                _add(out, "dp", "all_gather", 1, size)
            else:
                _add(out, "dp", "all_reduce", 1, size)
    if tp * pp * dp > 1:
        _add(out, "all", "all_reduce", 1, 8)
    return {axis: {op: {"count": cnt, "bytes": by} for op, (cnt, by) in ops.items()} for axis, ops in out.items()}


def world_comm(shape: Shape, layout, seq_len: int, global_batch: int, precision: str = "fp32") -> dict:
    """Per-step totals over all ranks (what the planner prices), {axis: {op: {count, bytes}}}."""
    tot = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in range(layout.tp * layout.pp * layout.dp):
        for axis, ops in rank_comm(shape, layout, seq_len, global_batch, r, precision).items():
            for op, v in ops.items():
                tot[axis][op][0] += v["count"]
                tot[axis][op][1] += v["bytes"]
    return {axis: {op: {"count": c, "bytes": b} for op, (c, b) in ops.items()} for axis, ops in tot.items()}
