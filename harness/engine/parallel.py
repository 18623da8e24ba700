"""One rank's parallel context: every axis it talks over, built once from the mesh and handed as one frozen
object to the model's modules and the step (Megatron-core's ProcessGroupCollection), instead of a degree,
an index and a group threaded separately through every constructor.

Each axis is a counted Axis (comm.py) over the mesh's group (topology.py): tp, cp, pp; dp, the replica
group dp x cp the gradients are reduced over; ep, the ranks sharing out a MoE's experts, and edp, those
holding the same experts (counted as "dp"); world, the step's one world-wide all-reduce. An axis of size
one is this rank alone and never calls torch.distributed. `region` is tensor parallelism's enter/leave
(with sequence parallelism when the layout asks for it and tp > 1): its tp axis and index are the
context's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.engine.comm import Axis, CommStats, StepClock
from harness.engine.tensor_parallel import Region
from harness.engine.topology import Mesh
from harness.parallel_dims import ParallelDims

# Which breakdown category each axis's blocking wait is charged to.
TIME_KEYS = {
    **{"tp": "tp_comm", "cp": "cp_comm", "pp": "bubble", "dp": "dp_comm", "all": "bubble"},
    **{"ep": "ep_comm", "edp": "dp_comm"},
}
# The process group each axis's collectives run over: the gradients' "dp" is the replica group (dp x cp);
# "ep" the expert-parallel ranks' all-to-alls; the experts' gradients ("edp", counted as "dp") their
# expert-data-parallel group's (harness.engine.topology).
GROUP_OF = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "replica", "all": "all", "ep": "ep", "edp": "edp"}
COUNTED_AS = {"edp": "dp"}


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's axes (sizes, indices, groups, counters) and its tensor-parallel region."""

    tp: Axis
    cp: Axis
    pp: Axis
    dp: Axis  # the replica group (dp x cp): the dense gradients' reduction and ZeRO-1 shards
    ep: Axis
    edp: Axis
    world: Axis  # counted as "all"
    region: Region

    @classmethod
    def of(cls, mesh: Mesh, stats: CommStats, sequence_parallel: bool = False) -> ParallelContext:
        """The axes of `mesh`'s rank, counted into `stats`; sequence parallelism only where tp > 1."""
        axes = {
            a: Axis(COUNTED_AS.get(a, a), mesh.groups[g], mesh.ranks[g], mesh.rank, stats, TIME_KEYS[a])
            for a, g in GROUP_OF.items()
        }
        tp = axes["tp"]
        return cls(
            tp=tp,
            cp=axes["cp"],
            pp=axes["pp"],
            dp=axes["dp"],
            ep=axes["ep"],
            edp=axes["edp"],
            world=axes["all"],
            region=Region(tp, sequence_parallel and tp.size > 1),
        )

    @classmethod
    def unconnected(cls, dims: ParallelDims, rank: int = 0, sequence_parallel: bool = False) -> ParallelContext:
        """`rank`'s axes with no process group behind them: sizes and indices only, for building modules
        on the meta device (the parameter list without processes); a collective over more than one rank fails."""
        return cls.of(Mesh(dims, rank, distributed=False), CommStats(StepClock(torch.device("cpu"))), sequence_parallel)

    @property
    def sp(self) -> bool:
        """Sequence parallelism: activations between regions hold seq/tp of the tokens."""
        return self.region.sp is not None
