"""Engine fsdp's activation checkpointing of whole blocks, torchtitan's way: each block wrapped by torch's
checkpoint_wrapper (non-reentrant) before fully_shard, so FSDP2's all-gather hooks sit on the wrapper,
outside the recomputed function. `full` recomputes the block; `selective_op` runs it under the per-op
policy (harness/model/op_checkpoint.py); `selective` is the model's own (its attention core)."""

from __future__ import annotations

CHECKPOINTING = {  # each mode in a report's words
    "none": "none",
    "full": "torch checkpoint_wrapper per block (non-reentrant)",
    "selective": "model's attention-core recomputation (torch checkpoint)",
    "selective_op": "torch checkpoint_wrapper per block with torchtitan's per-op policy (selective checkpoint "
    "contexts: every other matmul and the attention kernel saved)",
}


def wrap_blocks(part, mode: str) -> None:
    """Each of `part`'s blocks checkpoint-wrapped in place for `mode` full or selective_op (others: nothing)."""
    if mode not in ("full", "selective_op"):
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from harness.model.op_checkpoint import selective_op_contexts

    kw = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT}
    if mode == "selective_op":
        kw["context_fn"] = selective_op_contexts
    for key, block in list(part.layers.named_children()):
        part.layers.register_module(key, checkpoint_wrapper(block, **kw))
