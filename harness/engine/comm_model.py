"""Closed-form communication per training step: what the engine must send, by axis and op.

Pure functions of the model shape and the layout (no processes), so the planner can price a
layout before running it, and a test checks them exactly against the counters the engine
records (comm.CommStats). Conventions are comm.py's: bytes are this rank's payload per call
(all-reduce and p2p: the tensor; all-gather: the gathered tensor; reduce-scatter: its input).

Every entry also says its bytes by dtype ("bytes_by_dtype": {"fp32": n, "bf16": m}), from the
precision policy (harness.model.training.PrecisionPolicy): activations, their gradients and the
parameters are in the compute dtype (bf16 under precision bf16), the main gradients in
grad_accum_dtype, the DP reduction in grad_reduce_dtype; the loss's reductions are fp32.

Per micro-batch, with A = seq/cp x micro_batch x hidden x (2 under bf16, 4 under fp32) bytes:
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
  CP (axis cp, layout.cp > 1; context_parallel.py): per micro-batch and layer on this rank, with
      s = seq/cp local tokens, b = micro_batch_size, d = head_dim, hq = heads/tp, hkv = kv_heads/tp,
      KV = 2·b·hkv·s·d (K and V packed, KV heads unexpanded), e = the activations' dtype and
      F = the forward's runs (2 under full checkpointing, which re-runs the block in backward;
      1 otherwise: selective recomputes only rank-local math, no communication):
        ring       send and recv each: F·(cp-1) + (cp-1) of KV in e (the K/V hops, forward and
                   backward) and cp of KV in fp32 (the dK/dV accumulators, home after cp hops).
        allgather  all_gather: F + 1 of cp·KV in e (forward, and again in backward);
                   reduce_scatter: 1 of cp·KV in fp32 (the dK/dV).
        ulysses    all_to_all: F + 1 each of b·(hq + 2·hkv)·s·d (q, k, v packed; forward, and
                   their gradients) and of b·hq·s·d (the output; forward, and its gradient), in e.
      Every other term's activation A, the loss's rows and the PP messages hold seq/cp tokens.
  DP (axis dp, the replica group dp x cp, ParallelDims.replicas(); the engine names it "dp"): once
      per step per gradient bucket (buckets padded to a multiple of the replicas) when there is
      more than one replica: an all-reduce in grad_reduce_dtype, or under ZeRO-1 (shards over
      dp x cp) a reduce-scatter in grad_reduce_dtype and an all-gather of the updated parameters
      in their (compute) dtype. Muon under ZeRO-1 (axis dp_muon, harness/engine/muon.py): one fp32 all-gather
      of the padded bucket per bucket holding a block's matrix (the updates Newton-Schulz needs whole).
  all: one all-reduce of two fp32 numbers (loss, squared gradient norm).
"""

from __future__ import annotations

from collections import defaultdict

from harness.engine.comm import comm_dict, comm_entry
from harness.engine.data_parallel import plan_buckets
from harness.engine.model import rank_params
from harness.engine.muon import MUON_AXIS
from harness.engine.parallel import ParallelContext
from harness.engine.partition import rank_chunks
from harness.engine.schedules import Placement
from harness.model.muon import muon_matrix
from harness.model.presets import Shape
from harness.parallel_dims import ParallelDims
from harness.spec import model_chunks

SIZE = {"fp32": 4, "bf16": 2}


def _add(out, axis, op, count, elems, dtype):
    if count:
        e = out[axis][op]
        e[0] += count
        e[1] += count * elems * SIZE[dtype]
        e[2][dtype] += count * elems * SIZE[dtype]


def cp_attention_calls(
    impl: str,
    cp: int,
    batch: int,
    heads: int,
    kv_heads: int,
    tokens: int,
    head_dim: int,
    dtype: str,
    forward_runs: int = 1,
) -> list[tuple[str, int, int, str]]:
    """(op, count, elements per call, dtype) of one context-parallel attention call on one rank,
    forward (run forward_runs times) and backward; heads and kv_heads on this rank, tokens its
    local ones (the module docstring's CP terms)."""
    if cp == 1:
        return []
    kv = 2 * batch * kv_heads * tokens * head_dim
    if impl == "ring":
        hops = forward_runs * (cp - 1) + (cp - 1)
        return [
            ("send", hops, kv, dtype),
            ("recv", hops, kv, dtype),
            ("send", cp, kv, "fp32"),
            ("recv", cp, kv, "fp32"),
        ]
    if impl == "allgather":
        return [("all_gather", forward_runs + 1, cp * kv, dtype), ("reduce_scatter", 1, cp * kv, "fp32")]
    if impl == "ulysses":
        qkv = batch * (heads + 2 * kv_heads) * tokens * head_dim
        return [
            ("all_to_all", forward_runs + 1, qkv, dtype),
            ("all_to_all", forward_runs + 1, batch * heads * tokens * head_dim, dtype),
        ]
    raise ValueError(f"cp_impl {impl!r}")


def rank_comm(
    shape: Shape,
    layout,
    seq_len: int,
    global_batch: int,
    rank: int,
    precision: str = "fp32",
    grad_accum_dtype: str = "fp32",
    grad_reduce_dtype: str = "fp32",
    optimizer: str = "adamw",
) -> dict:
    """Expected {axis: {op: {count, bytes, bytes_by_dtype}}} for one step on one rank, under the
    precision policy named by `precision` and the workload's grad_accum_dtype/grad_reduce_dtype
    (both fp32 under precision fp32). A MoE's is not modelled: its all-to-alls' sizes are the routing's."""
    if shape.moe:
        raise ValueError("comm_model does not model a mixture of experts: its all-to-all sizes are data")
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    dims = ParallelDims.of(layout)
    cp = dims.degree("cp")
    replicas = dims.replicas()
    c = dims.coord(rank)
    sp = layout.sequence_parallel and tp > 1
    chunks = model_chunks(layout.pipeline_schedule, layout.virtual_stages)
    place = Placement.of(layout.pipeline_schedule, pp, chunks)
    mb = layout.micro_batch_size
    micro = global_batch // (dp * mb)
    tokens = seq_len // cp  # this rank's share of each sequence
    act, adt = tokens * mb * shape.hidden, precision  # elements and dtype of an activation
    out = defaultdict(lambda: defaultdict(comm_entry))
    full_ckpt = layout.activation_checkpointing == "full"
    stages = pp * chunks
    plans = rank_chunks(shape, place, c.pp, seq_len)
    for plan in plans:
        n = len(plan.layers)
        if tp > 1:
            regions = 2 * n  # attention and MLP: one enter and one leave each
            fwd_leave = regions + (1 if plan.first else 0)  # the embedding's leave too
            bwd_enter = regions + (1 if plan.last else 0)  # the head's enter too
            # full checkpointing recomputes both enters but, stopping early, only the first leave
            redo_enter, redo_leave = (2 * n, n) if full_ckpt else (0, 0)
            if sp:
                _add(out, "sp", "reduce_scatter", micro * (fwd_leave + bwd_enter + redo_leave), act, adt)
                _add(out, "sp", "all_gather", micro * (fwd_leave + bwd_enter + redo_enter), act, adt)
            else:
                _add(out, "tp", "all_reduce", micro * (fwd_leave + bwd_enter + redo_leave), act, adt)
            if plan.last:
                _add(out, "tp", "all_reduce", micro, tokens * mb, "fp32")
                _add(out, "tp", "all_reduce", micro, 2 * tokens * mb, "fp32")
        for op, count, elems, dtype in cp_attention_calls(
            layout.cp_impl,
            cp,
            mb,
            shape.heads // tp,
            shape.kv_heads // tp,
            tokens,
            shape.head_dim,
            adt,
            2 if full_ckpt else 1,
        ):
            _add(out, "cp", op, micro * n * count, elems, dtype)
        if pp > 1:
            p2p = act // tp if sp else act
            # a neighbour on this rank (a V's turn, interleaving at pp 1) is handed over, not sent
            if plan.stage > 0 and place.rank(plan.stage - 1) != c.pp:
                _add(out, "pp", "recv", micro, p2p, adt)
                _add(out, "pp", "send", micro, p2p, adt)
            if plan.stage < stages - 1 and place.rank(plan.stage + 1) != c.pp:
                _add(out, "pp", "send", micro, p2p, adt)
                _add(out, "pp", "recv", micro, p2p, adt)
    specs = rank_params(shape, plans, ParallelContext.unconnected(dims, rank, sp))
    buckets = plan_buckets(specs, max(1, int(layout.dp_bucket_mb * 2**20 / 4)), replicas, sp)
    for b in buckets:
        if b["sp"]:  # the norms' partial gradients (sequence under SP; the q/k norms' heads either way)
            _add(out, "sp" if sp else "tp", "all_reduce", 1, b["padded"], grad_accum_dtype)
        if replicas > 1:
            if layout.zero_stage == 1:
                _add(out, "dp", "reduce_scatter", 1, b["padded"], grad_reduce_dtype)
                _add(out, "dp", "all_gather", 1, b["padded"], precision)
                if optimizer == "muon" and any(muon_matrix(specs[i].name, specs[i].full) for i in b["indices"]):
                    _add(out, MUON_AXIS, "all_gather", 1, b["padded"], "fp32")  # the whole matrices' updates
            else:
                _add(out, "dp", "all_reduce", 1, b["padded"], grad_reduce_dtype)
    if dims.world > 1:
        _add(out, "all", "all_reduce", 1, 2, "fp32")
    return comm_dict(out)
