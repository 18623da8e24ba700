"""The balanced partition's dynamic programme over numpy arrays (engine/partition._integer_cuts, which a plan
asks of every pipeline depth) cuts where the loop (_cuts) cuts: every boundary, ties to the earlier one, for
the presets' costs and for small integer costs where ties abound; costs that are not integers take the loop."""

from __future__ import annotations

import itertools

import pytest

from harness.engine.partition import _cuts, _integer_cuts, embed_cost, head_cost, layer_cost
from harness.model.presets import PRESETS


@pytest.mark.parametrize("name", ["paper-65b", "llama3-70b", "llama3-8b", "qwen3-30b-a3b", "paper-13b"])
def test_the_arrays_cut_as_the_loop_on_the_presets(name):
    shape = PRESETS[name]
    n = shape.layers
    for seq, stages in itertools.product((2048, 131072), sorted({1, 2, 3, 5, 8, n // 4, n // 2, n - 1, n})):
        costs = (layer_cost(shape, seq), embed_cost(shape), head_cost(shape))
        assert _integer_cuts(n, stages, *costs) == _cuts(n, stages, *costs), (seq, stages)


def test_the_arrays_take_the_earlier_of_equal_boundaries():
    for n, stages, lc, embed, head in itertools.product((1, 5, 12), (1, 2, 3, 5, 12), (1, 2), (0, 1, 3), (0, 2, 7)):
        if stages <= n:
            assert _integer_cuts(n, stages, lc, embed, head) == _cuts(n, stages, lc, embed, head)


def test_costs_that_are_not_integers_are_left_to_the_loop():
    assert _integer_cuts(8, 2, 1.5, 0, 0) is None and _integer_cuts(8, 2, 2**60, 0, 0) is None
