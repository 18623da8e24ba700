"""The global gradient norm of an FSDP2 model: what clipping scales by and the parity check compares."""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_grad_norm(params: list, pp_group=None) -> torch.Tensor:
    """torch's total norm over every shard of every stage: the norm of this rank's DTensor gradients
    is reduced over their (dp, tp) mesh by full_tensor(); the pp stages' squared norms are summed
    over `pp_group` (None: one stage)."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm.float() ** 2
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
        norm = squared.sqrt()
    return norm
