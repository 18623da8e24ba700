"""The parallel degrees: the one owner of their product, their order and the ranks they give.

Every product or quotient of degrees (the world size, dp derived from a GPU count, the ranks a
stage or a group holds) is computed here and nowhere else. A new axis of the mesh is one more
entry in AXES (its place in the mesh) and LABEL_ORDER (in labels) and one more field; a degree that
splits other axes' ranks (ep) one more entry in SPLITS, one more field and the methods that say which
ranks it groups. To be accepted, labelled and planned it is, elsewhere, its Layout field
(harness/spec/schema.py) and the facts of the engines that run it: the labels and the planner
follow these lists (what an engine does with it is its own code). The mesh is a row-major grid
over AXES, the last axis innermost:
tensor parallelism talks on every layer, so its groups are consecutive ranks (inside one node
under every launcher's rank order); data parallelism talks once per step and pipeline
parallelism only at stage boundaries, so they may cross nodes. Everything is a pure function of
the degrees, testable for thousands of ranks without processes (torchtitan's ParallelDims).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import namedtuple
from dataclasses import dataclass

from harness.errors import SpecError

AXES = ("pp", "dp", "cp", "tp")  # the mesh's order, outermost first (Megatron's tp-cp-dp-pp, inside out)
LABEL_ORDER = ("tp", "cp", "pp", "dp")  # how a layout's label names them ('tp2 cp2 pp2 dp4')
# The axes a parameter is replicated over, whose gradients are summed and whose ranks share the
# ZeRO-1 shards: context-parallel ranks hold the same weights and see other tokens of the same
# sequences, so to the optimizer they are data parallelism (Megatron's data-parallel group with
# context parallelism). Its groups are counted and annotated under the name "dp".
REPLICA_AXES = ("dp", "cp")
# Degrees that split the ranks of other axes instead of multiplying the world: ep, a split of the replica
# ranks (ParallelDims.ep). Labels name them after the axes.
SPLITS = ("ep",)
DEGREES = (*AXES, *SPLITS)  # every degree a layout gives

Coord = namedtuple("Coord", AXES)  # a rank's place on every axis


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    # Expert parallelism: not an axis of its own but a split of the replica (dp x cp) ranks, as Megatron
    # carves it: each replica group is cut into ep-rank groups of consecutive members that share out the
    # experts (an all-to-all between them), and the members at the same place in each such group hold the
    # same experts and reduce their gradients together (the expert-data-parallel group, replicas / ep).
    ep: int = 1

    def __post_init__(self):
        for axis in DEGREES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"layout.{axis}", f"must be a positive integer, got {value!r}")

    # ------------------------------------------------------------ building

    @classmethod
    def of(cls, layout) -> ParallelDims:
        """The degrees of a Layout, of any object with the axes as attributes, or of a (partial)
        layout mapping as old records and compare runs hold it (a missing or empty degree is 1; a
        zero is refused, not read as missing)."""
        get = layout.get if isinstance(layout, dict) else (lambda k, d=None: getattr(layout, k, d))
        return cls(**{axis: 1 if get(axis) in (None, "") else int(get(axis)) for axis in DEGREES})

    @classmethod
    def derive(cls, world_size: int, field: str = "layout.dp", derived: str = "dp", **known: int) -> ParallelDims:
        """The degrees on `world_size` ranks with `derived` filled in from the others: the one rule
        for every place that derives a degree (compare, sweeps, the planner). A world size the
        others do not divide is a SpecError naming `field`."""
        fixed = cls(**{**known, derived: 1})
        if not fixed.divides(world_size):
            named = " x ".join(f"{a}={getattr(fixed, a)}" for a in AXES if a != derived and getattr(fixed, a) != 1)
            raise SpecError(field, f"world size {world_size} is not divisible by {named} = {fixed.world}")
        return dataclasses.replace(fixed, **{derived: world_size // fixed.world})

    # ------------------------------------------------------------ sizes

    def sizes(self) -> dict[str, int]:
        """Every degree, in the mesh's order."""
        return {axis: getattr(self, axis) for axis in AXES}

    def degree(self, axis: str) -> int:
        return self.sizes()[axis]

    def product(self, *axes: str) -> int:
        """The product of the named degrees (all of them: the world size)."""
        sizes = self.sizes()
        return math.prod(sizes[a] for a in (axes or AXES))

    def excluding(self, *axes: str) -> int:
        """The product of every degree but the named ones (tp x pp: the model-parallel size)."""
        return math.prod(v for a, v in self.sizes().items() if a not in axes)

    @property
    def world(self) -> int:
        return self.product()

    def divides(self, world_size: int) -> bool:
        """Whether these degrees tile `world_size` ranks a whole number of times (what derive needs
        of the degrees it is given; for the callers that skip such a world rather than refuse it)."""
        return world_size > 0 and world_size % self.world == 0

    def check_world(self, world_size: int, field: str = "layout") -> None:
        if self.world != world_size:
            raise SpecError(
                field,
                f"world size {world_size} != {' x '.join(LABEL_ORDER)} = "
                + " x ".join(str(self.degree(a)) for a in LABEL_ORDER),
            )

    def label(self) -> str:
        """The degrees other than 1, 'tp2 pp2' ('' when all are 1), the splits after them ('dp4 ep2')."""
        names = [f"{a}{self.degree(a)}" for a in LABEL_ORDER if self.degree(a) != 1]
        return " ".join(names + self.split_labels())

    def split_labels(self) -> list[str]:
        """The splits other than 1, as labels name them: ['ep2']."""
        return [f"{s}{getattr(self, s)}" for s in SPLITS if getattr(self, s) != 1]

    # ------------------------------------------------------------ experts

    def check_ep(self, field: str = "layout.ep") -> None:
        """ep must divide the replica ranks (dp x cp) it is carved from."""
        if self.replicas() % self.ep:
            raise SpecError(field, f"ep={self.ep} does not divide dp x cp = {self.dp} x {self.cp} = {self.replicas()}")

    def expert_data_parallel(self) -> int:
        """How many ranks hold each expert shard: the replicas over ep."""
        return self.replicas() // self.ep

    def expert_group_of(self, rank: int) -> list[int]:
        """The ep ranks `rank` shares the experts out with: consecutive members of its replica group."""
        group = self.flat_group_of(rank)
        start = group.index(rank) // self.ep * self.ep
        return group[start : start + self.ep]

    def expert_index(self, rank: int) -> int:
        """Which of the ep shares of the experts `rank` holds (its place in its expert group)."""
        return self.flat_group_of(rank).index(rank) % self.ep

    def expert_data_group_of(self, rank: int) -> list[int]:
        """The ranks that hold the same experts as `rank` and sum their gradients (every ep-th member
        of its replica group)."""
        group = self.flat_group_of(rank)
        return group[group.index(rank) % self.ep :: self.ep]

    def expert_groups(self) -> list[list[int]]:
        """Every expert group, each rank in one, in rank order of their first member."""
        return [list(g) for g in sorted({tuple(self.expert_group_of(r)) for r in range(self.world)})]

    def expert_data_groups(self) -> list[list[int]]:
        return [list(g) for g in sorted({tuple(self.expert_data_group_of(r)) for r in range(self.world)})]

    def expert_geometry(self, ranks_per_node: int) -> tuple[int, int, int]:
        """(span, members per node, nodes) of one expert group: its ep members are consecutive members
        of the flattened dp x cp group, which lie stride("cp") ranks apart (tp), so the group covers
        ep x stride("cp") consecutive ranks, aligned to that span (the replica group's first member is
        below stride("cp") and every ep-th member starts a group). Inside one node when ranks_per_node
        is a multiple of the span (the planner's all-to-all link)."""
        inner = self.stride("cp")
        span = self.ep * inner
        return span, max(1, min(self.ep, ranks_per_node // inner)), -(-span // ranks_per_node)

    # ------------------------------------------------------------ ranks

    def _strides(self) -> dict[str, int]:
        strides, step = {}, 1
        for axis in reversed(AXES):
            strides[axis], step = step, step * self.degree(axis)
        return strides

    def stride(self, axis: str) -> int:
        """The rank distance between neighbours on `axis`: the product of the axes inside it."""
        return self._strides()[axis]

    def span(self, axis: str) -> int:
        """How many consecutive ranks one group of `axis` lies in (its degree times its stride)."""
        return self.degree(axis) * self.stride(axis)

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world {self.world}")
        strides = self._strides()
        return Coord(**{a: rank // strides[a] % self.degree(a) for a in AXES})

    def rank(self, coord=None, **axes: int) -> int:
        """The rank at a coordinate (a Coord, or keywords; an axis not given is 0)."""
        where = {**(coord._asdict() if coord is not None else {}), **axes}
        strides = self._strides()
        return sum(where.get(a, 0) * strides[a] for a in AXES)

    def axis_groups(self) -> dict[str, list[list[int]]]:
        """For each axis, the rank groups that vary along it only (every rank in exactly one),
        listed in rank order of their first member."""
        out: dict[str, list[list[int]]] = {}
        for axis in AXES:
            groups: dict[tuple, list[int]] = {}
            for r in range(self.world):
                c = self.coord(r)
                groups.setdefault(tuple(v for a, v in c._asdict().items() if a != axis), []).append(r)
            out[axis] = list(groups.values())
        return out

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate with `rank` but the one on `axis`."""
        c = self.coord(rank)._asdict()
        return [self.rank(**{**c, axis: k}) for k in range(self.degree(axis))]

    def flat_group_of(self, rank: int, axes: tuple[str, ...] = REPLICA_AXES) -> list[int]:
        """The ranks that share every coordinate with `rank` but those on `axes`, in rank order
        (the dp x cp group a gradient is reduced over)."""
        c = self.coord(rank)._asdict()
        return sorted(
            self.rank(**{**c, **dict(zip(axes, values, strict=True))})
            for values in itertools.product(*(range(self.degree(a)) for a in axes))
        )

    def flat_groups(self, axes: tuple[str, ...] = REPLICA_AXES) -> list[list[int]]:
        """Every group flat_group_of gives (each rank in exactly one), in rank order of their first member."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world):
            if r not in seen:
                group = self.flat_group_of(r, axes)
                seen.update(dict.fromkeys(group, group))
        return sorted({id(g): g for g in seen.values()}.values())

    def replicas(self) -> int:
        """How many ranks hold each parameter shard: the product of REPLICA_AXES' degrees."""
        return self.product(*REPLICA_AXES)

    def axis_of_group(self, rank: int, ranks: list[int]) -> str | None:
        """The axis whose group (of `rank`) is exactly `ranks`: one of AXES, "dp" for the replica
        group when cp > 1 (it carries the gradient reduction), or None."""
        ranks = sorted(ranks)
        for axis in AXES:
            if self.degree(axis) > 1 and ranks == self.group_of(rank, axis):
                return axis
        if self.cp > 1 and self.dp > 1 and ranks == self.flat_group_of(rank):
            return "dp"
        return None

    def rank_table(self, ranks_per_node: int) -> list[dict]:
        """One row per rank: node, local rank and coordinates (what a run logs at start)."""
        return [
            {"rank": r, "node": r // ranks_per_node, "local_rank": r % ranks_per_node, **self.coord(r)._asdict()}
            for r in range(self.world)
        ]

    def within_node(self, axis: str, ranks_per_node: int) -> bool:
        """True when every group of `axis` lies inside one node. Only the innermost axes' groups
        are consecutive ranks, so this holds when their span divides the node's rank count."""
        return self.degree(axis) == 1 or ranks_per_node % self.span(axis) == 0

    def per_node(self, axis: str, ranks_per_node: int) -> int:
        """How many members of one group of `axis` a node holds (at least one)."""
        return max(1, min(self.degree(axis), ranks_per_node // self.stride(axis)))

    def nodes(self, axis: str, ranks_per_node: int) -> int:
        """How many nodes one group of `axis` reaches over (its span in whole nodes, at least one)."""
        return -(-self.span(axis) // ranks_per_node)

    def device_mesh(self, device_type: str):
        """torch's DeviceMesh over every axis in the mesh's order, named by the axes."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(self.sizes().values()), mesh_dim_names=AXES)
