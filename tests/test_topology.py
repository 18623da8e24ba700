"""The mesh is a pure function of the degrees (harness.parallel_dims): checked for large worlds
without processes, and the one rule that derives a degree from a world size."""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.parallel_dims import AXES, Coord, ParallelDims


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2), (8, 16, 32), (4, 8, 128), (8, 1, 512)])
def test_coords_roundtrip_and_groups_partition_the_world(tp, pp, dp):
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    world = tp * pp * dp
    assert dims.world == world
    seen = set()
    for r in range(world):
        c = dims.coord(r)
        assert dims.rank(c) == r
        seen.add((c.pp, c.dp, c.tp))
    assert len(seen) == world
    groups = dims.axis_groups()
    for axis, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        members = [r for g in groups[axis] for r in g]
        assert sorted(members) == list(range(world)), axis
        assert all(len(g) == size for g in groups[axis])
        for g in groups[axis]:  # a group varies only its own axis
            cs = [dims.coord(r) for r in g]
            for other in {"tp", "pp", "dp"} - {axis}:
                assert len({getattr(c, other) for c in cs}) == 1
        assert dims.group_of(groups[axis][-1][0], axis) == groups[axis][-1]


def test_4096_ranks_8_per_node_keeps_tp_inside_a_node():
    tp, pp, dp, per_node = 8, 16, 32, 8
    dims = ParallelDims(tp=tp, pp=pp, dp=dp)
    rows = dims.rank_table(per_node)
    assert len(rows) == 4096 and rows[-1]["node"] == 511
    for g in dims.axis_groups()["tp"]:
        assert len({r // per_node for r in g}) == 1
        assert g == list(range(g[0], g[0] + tp))  # consecutive ranks
    # dp neighbours are one TP group apart; pipeline stages are a whole (dp x tp) block apart
    assert dims.coord(8) == Coord(pp=0, dp=1, cp=0, tp=0)
    assert dims.coord(256) == Coord(pp=1, dp=0, cp=0, tp=0)
    assert ParallelDims(tp=8).within_node("tp", 8) and ParallelDims(tp=4).within_node("tp", 8)
    assert not ParallelDims(tp=16).within_node("tp", 8)


def test_tp_smaller_than_node_still_packs_groups_in_nodes():
    tp, pp, dp, per_node = 2, 4, 512, 8
    for g in ParallelDims(tp=tp, pp=pp, dp=dp).axis_groups()["tp"]:
        assert len({r // per_node for r in g}) == 1


def test_axis_order_is_named_once_and_the_last_axis_is_innermost():
    dims = ParallelDims(tp=2, pp=3, dp=4)
    assert list(dims.sizes()) == list(AXES) == list(Coord._fields)
    assert dims.rank(**{AXES[-1]: 1}) == 1
    assert dims.excluding("dp") == 6 and dims.product("tp", "dp") == 8
    assert ParallelDims.of({"tp": 2, "pp": None}) == ParallelDims(tp=2)


def test_dp_is_derived_by_one_rule_and_a_world_that_does_not_divide_names_the_field():
    assert ParallelDims.derive(16, tp=2, pp=2) == ParallelDims(tp=2, pp=2, dp=4)
    with pytest.raises(SpecError) as e:
        ParallelDims.derive(6, field="nproc", tp=4)
    assert e.value.field == "nproc" and "not divisible by" in e.value.reason
    with pytest.raises(SpecError) as e:
        ParallelDims(tp=2, dp=2).check_world(8)
    assert e.value.field == "layout" and "world size 8 != tp x cp x pp x dp = 2 x 1 x 1 x 2" in e.value.reason
    with pytest.raises(SpecError):
        ParallelDims(tp=0)
    with pytest.raises(SpecError):  # a zero degree is refused, not read as a missing one
        ParallelDims.of({"tp": 0})


def test_strides_spans_and_node_placement_follow_the_axis_order():
    dims = ParallelDims(tp=4, pp=2, dp=8)
    assert [dims.stride(a) for a in AXES] == [32, 4, 4, 1] and [dims.span(a) for a in AXES] == [64, 32, 4, 4]
    assert all(dims.group_of(0, a)[1] - dims.group_of(0, a)[0] == dims.stride(a) for a in AXES if dims.degree(a) > 1)
    # 8 ranks a node: a dp group (32 consecutive ranks, every 4th) has 2 members in each of 4 nodes
    assert dims.per_node("dp", 8) == 2 and dims.nodes("dp", 8) == 4
    for g in dims.axis_groups()["dp"]:
        assert len({r // 8 for r in g}) == 4 and all(sum(r // 8 == n for r in g) == 2 for n in {r // 8 for r in g})
    assert dims.per_node("tp", 8) == 4 and dims.nodes("tp", 8) == 1
    assert ParallelDims(tp=16, dp=4).per_node("dp", 8) == 1  # a tp group wider than a node: one dp member each


def test_a_world_the_degrees_do_not_tile_is_not_divided():
    assert ParallelDims(tp=2, pp=4).divides(16) and not ParallelDims(tp=2, pp=4).divides(12)
    assert not ParallelDims().divides(0)


def test_cp_sits_between_tp_and_dp_and_its_replica_group_spans_dp_and_cp():
    dims = ParallelDims(tp=2, cp=2, pp=2, dp=2)
    assert dims.world == 16 and dims.label() == "tp2 cp2 pp2 dp2"
    assert dims.group_of(0, "cp") == [0, 2] and dims.group_of(0, "tp") == [0, 1] and dims.group_of(0, "dp") == [0, 4]
    assert dims.flat_group_of(1) == [1, 3, 5, 7] and dims.replicas() == 4
    assert sorted(r for g in dims.flat_groups() for r in g) == list(range(16))
    assert dims.axis_of_group(5, [1, 3, 5, 7]) == "dp" and dims.axis_of_group(5, [5, 7]) == "cp"
    assert ParallelDims.derive(16, tp=2, cp=2) == ParallelDims(tp=2, cp=2, dp=4)
