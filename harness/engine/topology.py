"""This rank's process groups on the mesh that harness.parallel_dims lays out.

The mapping of ranks to coordinates is the degree owner's (ParallelDims); here each axis's
groups become torch process groups, built once per degrees and reused. One more group per rank
is not an axis: "replica", the ranks holding the same parameter shards (dp x cp, REPLICA_AXES),
over which gradients are reduced and ZeRO-1 shards; without cp it is the dp group itself. Under
expert parallelism (ep > 1) two more: "ep", the ranks sharing out the experts (their all-to-alls), and
"edp", the ranks holding the same experts (their gradients' reduction, ZeRO-1 shards; named "dp" to the
profiler: it is data parallelism's reduction); with ep 1 these are this rank alone and the replica group.
"""

from __future__ import annotations

from harness.parallel_dims import ParallelDims


def format_rank_map(rows: list[dict], limit: int = 64) -> str:
    axes = [k for k in rows[0] if k not in ("rank", "node", "local_rank")] if rows else []
    lines = [
        f"rank {r['rank']:>5} node {r['node']:>4} local {r['local_rank']:>2}  " + " ".join(f"{a} {r[a]}" for a in axes)
        for r in rows[:limit]
    ]
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more ranks")
    return "\n".join(lines)


class Mesh:
    """This rank's place in the mesh and its process groups (None where an axis has size 1).

    Every process must build the same meshes in the same order (torch's new_group contract);
    meshes are cached per degrees so that several engines in one process group reuse them.
    """

    _cache: dict = {}

    def __init__(self, dims: ParallelDims, rank: int, world_group=None, distributed: bool = True):
        self.dims = dims
        self.rank = rank
        self.coord = dims.coord(rank)
        self.groups: dict[str, object] = {}
        self.ranks: dict[str, list[int]] = {}
        named = dict(dims.axis_groups())
        if dims.cp > 1:
            named["replica"] = dims.flat_groups()
        if dims.ep > 1:
            named["ep"], named["edp"] = dims.expert_groups(), dims.expert_data_groups()
        for name, groups in named.items():
            for ranks in groups:
                group = None
                if distributed and len(ranks) > 1:
                    import torch.distributed as dist

                    # the axis it serves, for the profiler (harness.profiling.annotate): the replica
                    # group of dp1 x cp2 holds the cp group's very ranks but carries the gradients
                    group = dist.new_group(ranks, group_desc="dp" if name in ("replica", "edp") else name)
                if rank in ranks:
                    self.groups[name], self.ranks[name] = group, ranks
        if dims.cp == 1:
            self.groups["replica"], self.ranks["replica"] = self.groups["dp"], self.ranks["dp"]
        if dims.ep == 1:
            self.groups["ep"], self.ranks["ep"] = None, [rank]
            self.groups["edp"], self.ranks["edp"] = self.groups["replica"], self.ranks["replica"]
        self.groups["all"] = world_group
        self.ranks["all"] = list(range(dims.world))

    @classmethod
    def get(cls, dims: ParallelDims, rank: int, distributed: bool = True) -> Mesh:
        world = None
        if distributed and dims.world > 1:
            import torch.distributed as dist

            world = dist.group.WORLD
        key = (dims, rank, distributed, id(world))  # a new process group must not reuse old subgroups
        if key not in cls._cache:
            cls._cache[key] = cls(dims, rank, world, distributed)
        return cls._cache[key]

    def size(self, axis: str) -> int:
        return len(self.ranks[axis])

    def pp_rank_to_global(self, pp_rank: int) -> int:
        return self.ranks["pp"][pp_rank]
