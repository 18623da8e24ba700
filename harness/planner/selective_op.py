"""What a transformer layer keeps between its forward and backward under activation checkpointing, per
micro-batch and rank, for the modes that recompute (harness/planner/memory_engines.py asks kept_bytes):

  full          the layer's input only (the block re-runs in backward)
  selective_op  torchtitan's per-op policy (harness/model/op_checkpoint.py): the layer's input, which the
                checkpoint holds, and what the policy saves: the odd matmuls' outputs of a dense block
                (wq: heads x head_dim, wv: kv_heads x head_dim, w1: ffn, w2: hidden wide per token) and,
                with a flash-style kernel (not the materialised naive attention, whose bmm it does not
                save), the attention's output and fp32 log-sum-exp. Everything else is recomputed. The
                engines run it at tp = cp = 1 on dense models (their facts), which is all this counts.

Any other mode keeps what the layer's forward saves (`full`, the caller's figure). The planner's
Workload carries the precision's width (dtype_bytes).
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PlannerLayout, Workload


def selective_op_bytes(shape: Shape, lay: PlannerLayout, wl: Workload) -> float:
    """The per-op policy's kept bytes of one dense layer (module docstring), `wl` the rank's workload."""
    b, s, B = lay.micro_batch_size, wl.seq_len, wl.dtype_bytes
    n, d = b * s, shape.head_dim
    hq, kv = shape.heads * d, shape.kv_heads * d
    kept = n * shape.hidden * B  # the checkpoint's input
    kept += n * (hq + kv + shape.ffn + shape.hidden) * B  # wq, wv, w1, w2's outputs
    if ATTENTION_CLASS[lay.attention] not in MATERIALISED:
        kept += n * hq * B + 4 * b * shape.heads * s  # the attention kernel's output and log-sum-exp
    return kept


def kept_bytes(shape: Shape, lay: PlannerLayout, wl: Workload, full: float) -> float:
    """What a layer keeps under lay.activation_checkpointing, `full` being what its forward saves and `wl`
    the rank's workload (module docstring)."""
    if lay.activation_checkpointing == "full":
        sp = lay.sequence_parallel and lay.tp > 1
        return lay.micro_batch_size * wl.seq_len * shape.hidden * wl.dtype_bytes / (lay.tp if sp else 1)
    if lay.activation_checkpointing == "selective_op":
        return selective_op_bytes(shape, lay, wl)
    return full


RECOMPUTING = ("full", "selective_op")  # modes whose backward re-creates what the forward did not keep
