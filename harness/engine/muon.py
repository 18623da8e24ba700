"""Muon on the own engine's model states (harness.model.muon.MuonWithAdamW over ModelStates' views).

The optimizer updates one 1-D view per parameter (its part of this rank's ZeRO-1 shard). Without ZeRO a
view is the whole parameter, so Newton-Schulz takes it reshaped. Under ZeRO-1 a matrix may lie across
shards: for every bucket that holds a Muon matrix, each rank writes the Muon updates of its shard into a
zeroed flat copy of the bucket and an all-gather over the bucket's replica group (in place, as the
parameters' refresh) makes every matrix whole on every rank that holds part of it; each then
orthogonalises the whole matrix and keeps its own part. The gather is counted on axis "dp_muon"
(MUON_AXIS: one all-gather of the padded bucket in fp32 per such bucket and step) and its time is
charged to dp_comm, not to the optimizer (MUON_TIME, moved by the engine after the step).
"""

from __future__ import annotations

import torch

from harness.model.muon import MuonWithAdamW, muon_matrix

MUON_AXIS = "dp_muon"  # the comm census's name for the gather Newton-Schulz needs under ZeRO-1
MUON_TIME = "muon_gather"  # the clock's key for its wait (the engine moves it into dp_comm)


class ZeroWhole:
    """harness.model.muon's Whole for ZeRO-1 shards: entries[i] = (group, bucket, a, e, a2, e2, shape), the
    matrix's range [a, e) in its bucket and the part [a2, e2) this rank holds."""

    what = "under ZeRO-1 each bucket's updates all-gathered whole over dp (comm axis dp_muon)"

    def __init__(self, entries: list[tuple], buckets: list[tuple]):
        self.entries, self.buckets = entries, buckets  # buckets: (group, bucket) holding a Muon matrix

    def batches(self) -> list[tuple]:
        """One batch per bucket holding a Muon matrix under ZeRO-1, keyed by it (every rank gathers it, holding
        a part of one or not), in the buckets' order; without ZeRO each matrix alone (key None)."""
        whole = [(None, [i]) for i, entry in enumerate(self.entries) if not entry[0].zero]
        return whole + [
            ((g, b), [i for i, entry in enumerate(self.entries) if entry[1] is b]) for g, b in self.buckets if g.zero
        ]

    def full(self, key, batch: list[int], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        if key is None:
            return [updates[k].view(self.entries[i][-1]) for k, i in enumerate(batch)]
        return self._gathered(*key, batch, updates)

    def _gathered(self, g, b, batch: list[int], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Bucket b's Muon updates, each rank's part written into a zeroed flat copy, all-gathered in place."""
        dtype = b.master.dtype if b.master is not None else b.param_flat.dtype  # the optimizer's
        flat = torch.zeros(b.padded, dtype=dtype, device=b.param_flat.device)
        for k, i in enumerate(batch):
            _, _, _, _, a2, e2, _ = self.entries[i]
            flat[a2:e2] = updates[k]
        lo, hi = b.mine
        g.dp.labelled(MUON_AXIS, MUON_TIME).all_gather(flat[lo:hi], out=flat)
        return [flat[a:e].view(shape) for _, _, a, e, _, _, shape in (self.entries[i] for i in batch)]

    def mine(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        _, _, a, _, a2, e2, _ = self.entries[index]
        return whole.reshape(-1)[a2 - a : e2 - a]


def muon_optimizer(states, workload, fused: bool = False) -> MuonWithAdamW:
    """MuonWithAdamW over `states`' (StateGroups) optimizer views: the blocks' matrices (ParamSpec names and
    shapes: whole under tp 1, the facts' limit) with ZeroWhole, the rest AdamW."""
    matrices, shapes, entries, others, buckets = [], [], [], [], []
    for g in states.groups:
        views = iter(g.views)
        for b in g.buckets:
            lo, hi = b.mine
            if any(muon_matrix(s.name, s.full) for s in b.specs):
                buckets.append((g, b))
            for (a, e), spec in zip(b.ranges, b.specs, strict=True):
                a2, e2 = max(a, lo), min(e, hi)
                if a2 >= e2:
                    continue
                vb, _, _, t = next(views)
                assert vb is b
                if muon_matrix(spec.name, spec.full):
                    matrices.append(t)
                    shapes.append(spec.full)
                    entries.append((g, b, a, e, a2, e2, spec.full))
                else:
                    others.append(t)
    return MuonWithAdamW(matrices, others, workload, shapes, ZeroWhole(entries, buckets), fused=fused)
