"""The (pp, dp, tp) device mesh, tp innermost.

Tensor parallelism talks on every layer, so its groups must be consecutive ranks (inside one
node under every launcher's rank order); data parallelism talks once per step and pipeline
parallelism only at stage boundaries, so they may cross nodes. The mapping is a pure function
of the degrees so it can be tested for thousands of ranks without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Coord:
    pp: int
    dp: int
    tp: int


def coord_of(rank: int, tp: int, pp: int, dp: int) -> Coord:
    if not 0 <= rank < tp * pp * dp:
        raise ValueError(f"rank {rank} outside world {tp * pp * dp}")
    return Coord(pp=rank // (tp * dp), dp=(rank // tp) % dp, tp=rank % tp)


def rank_of(c: Coord, tp: int, pp: int, dp: int) -> int:
    return (c.pp * dp + c.dp) * tp + c.tp


def axis_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """For each axis, the list of rank groups that vary along it (every rank in exactly one)."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    out: dict[str, list[list[int]]] = {}
    for axis in AXES:
        others = [a for a in AXES if a != axis]
        groups = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                fixed = {others[0]: i, others[1]: j}
                groups.append([rank_of(Coord(**{**fixed, axis: k}), tp, pp, dp) for k in range(sizes[axis])])
        out[axis] = groups
    return out


def rank_map(tp: int, pp: int, dp: int, ranks_per_node: int) -> list[dict]:
    """One row per rank: node, local rank and mesh coordinates (what the run logs at start)."""
    rows = []
    for r in range(tp * pp * dp):
        c = coord_of(r, tp, pp, dp)
        rows.append({"rank": r, "node": r // ranks_per_node, "local_rank": r % ranks_per_node,
                     "pp": c.pp, "dp": c.dp, "tp": c.tp})
    return rows


def tp_within_node(tp: int, ranks_per_node: int) -> bool:
    """True when every TP group lies inside one node (tp divides the node's rank count)."""
    return ranks_per_node % tp == 0 or tp == 1


def format_rank_map(rows: list[dict], limit: int = 64) -> str:
    lines = [f"rank {r['rank']:>5} node {r['node']:>4} local {r['local_rank']:>2}  "
             f"pp {r['pp']} dp {r['dp']} tp {r['tp']}" for r in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more ranks")
    return "\n".join(lines)


class Mesh:
    """This rank's place in the mesh and its process groups (None where an axis has size 1).

    Every process must build the same meshes in the same order (torch's new_group contract);
    meshes are cached per degrees so that several engines in one process group reuse them.
    """

    _cache: dict = {}

    def __init__(self, tp: int, pp: int, dp: int, rank: int, world_group=None, distributed: bool = True):
        self.tp, self.pp, self.dp = tp, pp, dp
        self.rank = rank
        self.coord = coord_of(rank, tp, pp, dp)
        self.groups: dict[str, object] = {}
        self.ranks: dict[str, list[int]] = {}
        for axis, groups in axis_groups(tp, pp, dp).items():
            for ranks in groups:
                group = None
                if distributed and len(ranks) > 1:
                    import torch.distributed as dist

                    group = dist.new_group(ranks)
                if rank in ranks:
                    self.groups[axis], self.ranks[axis] = group, ranks
        self.groups["all"] = world_group
        self.ranks["all"] = list(range(tp * pp * dp))

    @classmethod
    def get(cls, tp: int, pp: int, dp: int, rank: int, distributed: bool = True) -> "Mesh":
        world_id = None
        if distributed and tp * pp * dp > 1:
            import torch.distributed as dist

            world_id = id(dist.group.WORLD)  # a new process group must not reuse old subgroups
        key = (tp, pp, dp, rank, distributed, world_id)
        if key not in cls._cache:
            world = None
            if distributed and tp * pp * dp > 1:
                import torch.distributed as dist

                world = dist.group.WORLD
            cls._cache[key] = cls(tp, pp, dp, rank, world, distributed)
        return cls._cache[key]

    def size(self, axis: str) -> int:
        return len(self.ranks[axis])

    def pp_rank_to_global(self, pp_rank: int) -> int:
        return self.ranks["pp"][pp_rank]
