"""Muon under FSDP2 (harness.model.muon.MuonWithAdamW over DTensor parameters): Newton-Schulz needs each
matrix whole, and FSDP2 holds a Shard(0) of it per rank. Each step, every Muon matrix's update (what this
rank holds of it, after the momentum) is all-gathered whole by DTensor's full_tensor() over the
parameter's mesh, orthogonalised on every rank, and each rank keeps its rows (the offsets DTensor gives its
shard). The gathers are counted per step (DTensorWhole.counts: the comm census's axis "dp_muon", one
all-gather of the whole fp32 matrix per Muon parameter), as the own engine counts its ZeRO-1 gather.
"""

from __future__ import annotations

import torch

from harness.model.muon import make_optimizer

MUON_AXIS = "dp_muon"


class DTensorWhole:
    """harness.model.muon's Whole for DTensor matrices (plain tensors: whole already)."""

    what = "each FSDP2-sharded matrix's update gathered whole by full_tensor (comm axis dp_muon)"

    def __init__(self, matrices: list, shapes: list):
        self.matrices, self.shapes = matrices, shapes
        self.reset()

    def reset(self) -> None:
        self.count, self.bytes, self.by_dtype = 0, 0, {}

    def batches(self) -> list[tuple]:
        """Each matrix alone (every rank holds a shard of each, so all take part in each gather, in order)."""
        return [(None, [i]) for i in range(len(self.matrices))]

    def full(self, key, batch: list[int], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = []
        for i, u in zip(batch, updates, strict=True):
            p, shape = self.matrices[i], self.shapes[i]
            if not isinstance(p, DTensor) or p.device_mesh.size() == 1:
                out.append(u.view(shape))
                continue
            whole = DTensor.from_local(
                u, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            ).full_tensor()
            size = whole.numel() * whole.element_size()
            self.count, self.bytes = self.count + 1, self.bytes + size
            key = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(whole.dtype, str(whole.dtype))
            self.by_dtype[key] = self.by_dtype.get(key, 0) + size
            out.append(whole)
        return out

    def mine(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        p = self.matrices[index]
        if not isinstance(p, DTensor):
            return whole
        return whole[shard_slices(p)]

    def comm(self) -> dict:
        """The last step's gathers in the comm census's shape ({axis: {op: {count, bytes, bytes_by_dtype}}})."""
        if not self.count:
            return {}
        return {MUON_AXIS: {"all_gather": {"count": self.count, "bytes": self.bytes, "bytes_by_dtype": self.by_dtype}}}


def shard_slices(p) -> tuple:
    """The rows and columns of DTensor `p` this rank holds, in Python integers (DTensor's own
    compute_local_shape_and_global_offset reads tensors, which a fake-tensor trace cannot): each Shard(d)
    splits dim d as torch.chunk does (ceil-sized pieces, the last ones short or empty), as FSDP2 shards."""
    from torch.distributed.tensor import Shard

    start, stop = [0] * p.ndim, list(p.shape)
    coordinate = p.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            d, n = placement.dim, p.device_mesh.size(mesh_dim)
            chunk = -(-(stop[d] - start[d]) // n)
            lo = min(stop[d], start[d] + coordinate[mesh_dim] * chunk)
            start[d], stop[d] = lo, min(stop[d], lo + chunk)
    return tuple(slice(a, b) for a, b in zip(start, stop, strict=True))


def fsdp_optimizer(parts, workload, make_adamw, fused: bool):
    """The workload's optimizer over the parts' (FSDP2-sharded) parameters: make_adamw's (BuildOptions'), or
    Muon on the blocks' matrices, named as the plain model's, with DTensorWhole."""
    if workload.optimizer.name != "muon":
        return make_adamw([p for part in parts for p in part.parameters()], workload, fused=fused)
    named = [(n, p) for part in parts for n, p in part.named_parameters()]
    return make_optimizer(named, workload, fused=fused, whole=DTensorWhole)


def step_comm(optimizer) -> dict:
    """{"comm": the last step's Muon gathers} (then counted afresh), or {} for an optimizer that gathers nothing."""
    whole = getattr(optimizer, "whole", None)
    if not isinstance(whole, DTensorWhole):
        return {}
    out = {"comm": whole.comm()}
    whole.reset()
    return out
