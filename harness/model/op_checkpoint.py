"""Per-op selective activation checkpointing (`activation_checkpointing: selective_op`): torchtitan's
per-op policy, written here on torch.utils.checkpoint's create_selective_checkpoint_contexts. Inside a
checkpointed transformer block the outputs of the attention kernel and of every other matmul (the 1st,
3rd, ... aten.mm of the block's forward: wq, wv, w1, w2 in a dense block) are saved; everything else
(norms, rotary, wk, wo, w3, SwiGLU's elementwise math) is recomputed in backward. A matmul is aten.mm or,
with a bias, aten.addmm. The count is per block call; torch 2.13 asks the policy in the forward only and
replays its decisions by index in the recomputation (SelectiveCheckpointContext.is_recompute is always
False there).

What the planner keeps per layer under it (harness/planner/memory_recipes.py, per_op_kept) is this list's.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from harness.measure.census import note_saved

MATMULS = frozenset((torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
# the attention kernels' ops whose outputs are saved (torchtitan's list, with the CPU flash kernel the harness runs)
ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
)


def selective_op_policy(decisions: list | None = None):
    """The policy for one block call (its own matmul count); `decisions` collects (op, saved, output, args) as
    it decides (tests)."""
    matmuls = [0]

    def policy(ctx, func, *args, **kwargs):
        if func in MATMULS:
            matmuls[0] += 1
            save = matmuls[0] % 2 == 1
        else:
            save = func in ATTENTION_OPS
        if decisions is not None:
            decisions.append((func, save, ctx.op_output, args))
        if save:  # kept in the policy's cache, where saved-tensor hooks do not look: the census counts it
            outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
            for t in outputs:
                if isinstance(t, torch.Tensor):
                    note_saved(t)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_op_contexts():
    """A context_fn for torch.utils.checkpoint.checkpoint (non-reentrant) with the policy above; a fresh
    count per call, so each block call saves its own odd matmuls."""
    return create_selective_checkpoint_contexts(selective_op_policy())


def checkpoint_block(block, *args):
    """block(*args) under the per-op policy (torch's non-reentrant checkpoint)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(block, *args, use_reentrant=False, context_fn=selective_op_contexts)
