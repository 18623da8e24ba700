"""The caching allocator's reserve at a stage's peak: cached free blocks that the requests of the peak cannot reuse.

PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp; harness/memtrace/allocator.py replays its
rules) serves a request only from a cached free block at least its size (best fit), never merges two segments,
and returns none to the driver while memory is to spare: a request larger than every free block takes a new
segment, and the free blocks stay reserved beside it. What torchtitan logs as its memory is that reserved peak
(reserved_bytes.all.peak). Two such blocks follow from the planner's own terms, in bytes, with no constant:

- the logits freed before the loss's backward (engine fsdp without a pipeline: torchtitan's train step, `del pred`
  before loss.backward()): the LM head's n x V/t logits in the compute dtype (V/t: loss_parallel's shard), after
  which every request of the loss is an fp32 tensor of the same shape (log-softmax, zeros_like, exp: twice the
  block; fp32 logits are the requests' own size, and reused), so the block stays reserved through the loss's peak.
  (The harness's engine keeps the logits referenced instead, which holds the same bytes.) The stage's reserved peak
  is its loss candidate plus the block, where that exceeds the stage's live peak: `logits_block`.
- the pipeline's merged outputs (pp_outputs_kept): torch.distributed.pipelining's step(return_outputs=True)
  concatenates the last stage's m kept outputs after the step's last backward (_merge_outputs, merge_chunks:
  torch.cat), one request of m x n x V/t bytes of the logits' dtype. Where that is larger than every block the
  step frees before it (the loss's fp32 blocks, 4 n V/t; the LM head's fp32 gradient, 4 V h/t; on a stage holding
  the embedding too, FSDP2's fp32 accumulation of its whole table under TP, 4 V h) it takes a new segment above
  the step's reserved high-water: `merged_outputs_block`.

Under expandable_segments (PlannerLayout.expandable_segments; PyTorch's default is off, torchtitan's run_llama_train.sh
sets it, its multi-node slurm script does not) a pool is one segment whose free tail grows by what a request lacks: the
step's end leaves the tail free, so the merge reuses it and reserves no segment of its own, while the logits' block,
freed with the fp32 copy allocated after it, stays stranded inside the segment. Checked against the traced steps
replayed through the allocator's rules, with and without expandable segments (tests/test_planner_reserve.py;
benchmarks/torchtitan_reserved.py prints the replay's free blocks at its peak beside these terms).
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner.layout import PlannerLayout, Workload


def logits_block(shape: Shape, lay: PlannerLayout, wl: Workload, has_head: bool, shards: int) -> float:
    """Bytes of the logits block freed before the loss's backward and stranded by it (module docstring): engine
    fsdp's last (only) stage without a pipeline; 0 elsewhere. `shards`: the logits' vocabulary shards."""
    if not has_head or lay.engine != "fsdp" or lay.pp > 1 or wl.dtype_bytes >= 4:  # fp32: the loss's own size
        return 0.0
    return lay.micro_batch_size * wl.local(lay).seq_len * shape.vocab / shards * wl.dtype_bytes


def merged_outputs_block(
    shape: Shape, lay: PlannerLayout, wl: Workload, has_emb: bool, has_head: bool, kept: float, shards: int
) -> float:
    """Bytes of the pipeline's merged outputs (`kept`: recipes.kept_outputs_bytes, the m kept outputs) where the
    one request is larger than every block the step frees before it (module docstring), else 0."""
    if not has_head or not kept or lay.expandable_segments:  # the free tail grows into it
        return 0.0
    n, V, h = lay.micro_batch_size * wl.local(lay).seq_len, shape.vocab, shape.hidden
    largest = max(4 * n * V / shards, 4 * V * h / lay.tp, 4 * V * h if has_emb else 0.0)
    return kept if kept > largest else 0.0


def reserve(logits: float, loss_candidate: float, live_extra: float, merged: float) -> float:
    """The stage's reserved bytes above its live peak: the stranded logits block where the loss's reserved peak
    (its candidate plus the block) exceeds the chosen live extra, and the merged outputs' new segment."""
    return (max(0.0, loss_candidate + logits - live_extra) if logits else 0.0) + merged
