"""The global gradient norm of an FSDP2 model: what clipping scales by and the parity check compares."""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_experts(named: list[tuple], ep: bool) -> list[list]:
    """The parameters ((name, parameter) pairs) as [all] without expert parallelism; with it [the rest, the
    experts]: DTensors of two meshes (dp and dp_mod_ep), which one norm or one foreach op over both would mix."""
    if not ep:
        return [[p for _, p in named]]
    from harness.frameworks.fsdp.experts import is_expert

    return [[p for n, p in named if not is_expert(n)], [p for n, p in named if is_expert(n)]]


def _norm(params: list) -> torch.Tensor:
    """The parameters' gradient norm over every shard: this rank's DTensor norm reduced over their (dp, tp)
    mesh by full_tensor()."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _squared(params: list) -> torch.Tensor:
    return _norm(params).float() ** 2


def global_grad_norm(groups: list[list], pp_group=None, ep_group=None) -> torch.Tensor:
    """torch's total norm over every shard of every stage: each group's (split_experts) squared norm over
    its mesh, the experts' (the second group) summed over `ep_group` (each ep rank holds other experts),
    and the pp stages' summed over `pp_group` (None: one stage)."""
    if len(groups) == 1 and pp_group is None:
        return _norm(groups[0])
    squared = _squared(groups[0])
    if len(groups) > 1:
        experts = _squared(groups[1])
        dist.all_reduce(experts, op=dist.ReduceOp.SUM, group=ep_group)
        squared = squared + experts
    if pp_group is not None:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
    return squared.sqrt()
