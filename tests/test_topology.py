"""The (pp, dp, tp) mesh is a pure function: check it for large worlds without processes."""

from __future__ import annotations

import pytest

from harness.engine.topology import Coord, axis_groups, coord_of, rank_map, rank_of, tp_within_node


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2), (8, 16, 32), (4, 8, 128), (8, 1, 512)])
def test_coords_roundtrip_and_groups_partition_the_world(tp, pp, dp):
    world = tp * pp * dp
    seen = set()
    for r in range(world):
        c = coord_of(r, tp, pp, dp)
        assert rank_of(c, tp, pp, dp) == r
        seen.add((c.pp, c.dp, c.tp))
    assert len(seen) == world
    groups = axis_groups(tp, pp, dp)
    for axis, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        members = [r for g in groups[axis] for r in g]
        assert sorted(members) == list(range(world)), axis
        assert all(len(g) == size for g in groups[axis])
        for g in groups[axis]:  # a group varies only its own axis
            cs = [coord_of(r, tp, pp, dp) for r in g]
            for other in {"tp", "pp", "dp"} - {axis}:
                assert len({getattr(c, other) for c in cs}) == 1


def test_4096_ranks_8_per_node_keeps_tp_inside_a_node():
    tp, pp, dp, per_node = 8, 16, 32, 8
    rows = rank_map(tp, pp, dp, per_node)
    assert len(rows) == 4096 and rows[-1]["node"] == 511
    for g in axis_groups(tp, pp, dp)["tp"]:
        assert len({r // per_node for r in g}) == 1
        assert g == list(range(g[0], g[0] + tp))  # consecutive ranks
    # dp neighbours are one TP group apart; pipeline stages are a whole (dp x tp) block apart
    assert coord_of(8, tp, pp, dp) == Coord(pp=0, dp=1, tp=0)
    assert coord_of(256, tp, pp, dp) == Coord(pp=1, dp=0, tp=0)
    assert tp_within_node(8, 8) and tp_within_node(4, 8) and not tp_within_node(16, 8)


def test_tp_smaller_than_node_still_packs_groups_in_nodes():
    tp, pp, dp, per_node = 2, 4, 512, 8
    for g in axis_groups(tp, pp, dp)["tp"]:
        assert len({r // per_node for r in g}) == 1
