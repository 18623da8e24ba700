"""What engine fsdp (FSDP2, harness/frameworks/fsdp/engine.py) holds during its step beyond the model
states and the plain model's activations (fsdp_step_bytes), split from memory_engines, which adds it
to a stage's memory."""

from __future__ import annotations

import functools

from harness.model.presets import Shape
from harness.planner import feedforward, fp8, schedules
from harness.planner import memory_terms as terms
from harness.planner.layout import PlannerLayout, Workload


def fsdp_step_bytes(
    shape: Shape, lay: PlannerLayout, wl: Workload, has_emb: bool, layers: int, has_head: bool, loss_shards: int = 1
) -> dict:
    """What engine fsdp (FSDP2 fully_shard per block and on the root, harness/frameworks/fsdp/engine.py)
    holds during its step beyond the model states and the plain model's activations, per rank,
    as torch's FSDP2 code allocates it (torch/distributed/fsdp/_fully_shard/) and `harness memory`
    traces it:

      gathered        the root's unsharded parameters in the compute dtype (embedding, final
                      norm, LM head; fully_shard(root, reshard_after_forward=False): gathered from
                      the first forward to the end of the last backward)
      backward_blocks while a block runs backward, its gathered parameters and the next block's,
                      whose flat all-gather output exists from when the all-gather is issued ahead
                      (_fsdp_state backward prefetch; _fsdp_collectives.foreach_all_gather); with
                      reshard_after_forward true no block is gathered between its forward and
                      backward (the loss's peak has none)
      kept_blocks     with reshard_after_forward false every block stays gathered from its
                      forward to its backward: all of them at the loss's peak and the first
                      block's backward
      reduce_scatter  one block's reduce-scatter input in the reduce dtype (foreach_reduce), which
                      FSDP2 keeps (comm_ctx.reduce_scatter_state) until the next reduce-scatter
                      waits, so one is alive whenever a block's backward runs
      after_loss      while the blocks run backward: the step's logits in the compute dtype (the
                      train step's variable keeps them through loss.backward(); their vocab / tp
                      columns under a vocabulary-parallel loss, `loss_shards` = tp: torchtitan's
                      loss_parallel keeps the logits a DTensor sharded on the vocabulary) and the LM head's
                      unsharded weight gradient, reduced only with the root after the last block

    Under pipelining (pp > 1) torch.distributed.pipelining runs every backward but the reduction
    with set_reshard_after_backward(False) and set_requires_gradient_sync(False)
    (pipelining/stage.py, backward_maybe_with_nosync; perform_reduce_grad after the last):

      accumulated     the stage's unsharded gradients, accumulated in the reduce dtype from its
                      first backward to the reduce-scatter after its last (the sharded gradients
                      exist only after that, with the activations gone); the embedding's is the
                      whole table's under TP (DTensor's backward of the RowwiseParallel embedding)
      all_blocks      every block stays gathered from its backward until the next forward of it
                      reshards it (reshard_after_forward): between two backwards all are gathered
      reduce_scatter  none while micro-batches are in flight

    With several chunks a rank, each chunk's accumulation is reduced after its own last backward; in one round of
    torch's ScheduleInterleaved1F1B that leaves one chunk's alive at a time (one_round_chunks).

    The planner's workload carries the default precision policy: compute dtype = the workload's,
    reduction in fp32; under fp8 the blocks' linear weights are gathered in fp8 (fp8.py)."""
    B, t = wl.dtype_bytes, lay.tp
    h, V = shape.hidden, shape.vocab
    block = terms.stage_params(shape, False, 1, False, t, lay.ep)  # one block's parameters (its experts E / ep)
    vocab = V * h / t
    head = 0.0 if shape.tie_embeddings and has_emb else vocab
    root = (vocab if has_emb else 0.0) + ((head + h) if has_head else 0.0)
    reshard = lay.reshard_after_forward
    n = lay.micro_batch_size * wl.local(lay).seq_len
    weights = feedforward.of(shape).weight_shape(lay.ep)  # a MoE layer's: its rank's experts
    fp8_saving = fp8.gathered_block_saving(weights, lay, B) if lay.precision == "fp8" else 0
    block_bytes = block * B - fp8_saving
    kept = 0.0 if reshard else layers * block_bytes
    piped = lay.pp > 1
    # the embedding's gradient is the whole table's under TP (see engine_stage_memory)
    emb_grad = V * h if has_emb else 0.0
    accumulated = root - (vocab if has_emb else 0.0) + emb_grad + layers * block
    return {
        "gathered": root * B,
        "backward_blocks": min(2, layers) * block_bytes if reshard else kept,
        "kept_blocks": kept,
        "all_blocks": layers * block_bytes,
        "reduce_scatter": block * 4 if layers and not piped else 0.0,
        "accumulated": accumulated * 4 if piped else 0.0,
        "after_loss": (n * V * B / loss_shards + vocab * B) if has_head else 0.0,
    }


def one_round_chunks(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int) -> list[tuple[float, float]] | None:
    """(in flight, accumulated gradient bytes) at each chunk's first backward on pipeline rank `stage` of engine
    fsdp under torch's interleaved order in one round (m < 2 pp), else None. torch.distributed.pipelining
    reduces a stage's gradients right after its last backward (schedules._add_reduce_grad: REDUCE_GRAD ->
    stage.perform_reduce_grad, FSDP2's post_backward with set_reshard_after_backward(True)), and in one round
    a rank runs each chunk's backwards back to back (schedules.chunk_in_flight), so only that chunk's unsharded
    gradients live: its blocks', the embedding's whole table on the first stage, the LM head and final norm's on
    the last (fsdp_step_bytes' accumulated, per chunk)."""
    pp, v, m = lay.pp, lay.virtual_stages, wl.micro_batches(lay)
    if lay.engine != "fsdp" or pp == 1 or lay.pipeline_schedule != "interleaved" or v < 2 or m // pp > 1:
        return None
    h, V, t = shape.hidden, shape.vocab, lay.tp
    block = terms.stage_params(shape, False, 1, False, t, lay.ep)
    parts = _layers_per_stage(shape, pp * v, wl.seq_len)
    out = []
    for c in range(v):
        emb = V * h if c == 0 and stage == 0 else 0.0  # the whole table under TP (see fsdp_step_bytes)
        head = V * h / t + h if c == v - 1 and stage == pp - 1 else 0.0
        grads = 4 * (emb + head + parts[c * pp + stage] * block)
        out.append((schedules.chunk_in_flight(v, pp, stage, m, c), grads))
    return out


@functools.lru_cache(maxsize=1024)
def _layers_per_stage(shape: Shape, stages: int, seq_len: int) -> tuple[int, ...]:
    """Layers of each of the engine's stages (its balanced partition, as memory_engines splits them)."""
    from harness.engine.partition import balanced_partition

    return tuple(len(part) for part in balanced_partition(shape, stages, seq_len))
