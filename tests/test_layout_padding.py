"""The padding figures of docs/parameters.md (`overlap.plan.layout_padding`)."""
from __future__ import annotations

import math

from overlap.plan.layout_padding import llama_layer_shapes, llama_root_shapes, unit_padding


def test_padding_of_one_dimensional_groups_is_the_plain_padding() -> None:
    unit = unit_padding("norms", [(5,), (7,), (1,)], 4, 4)
    assert unit.padding_numel == unit.plain_padding_numel == 3 and unit.extra_bytes == 0


def test_row_alignment_adds_at_most_a_row_per_boundary() -> None:
    unit = unit_padding("tiny", [(3, 3), (3,)], 3, 4)       # a shard of 4 would cut a row of 3
    assert unit.numel == 12 and unit.padding_numel == 6 and unit.plain_padding_numel == 0
    assert unit.padding_bytes == 24 and unit.extra_bytes == 24


def test_llama_8b_padding_is_a_small_share() -> None:
    layer = llama_layer_shapes()
    assert sum(math.prod(shape) for shape in layer) == 218_112_000
    for world in (8, 64):
        unit = unit_padding("layer", layer, world, 2)
        widest_row = 14336
        assert unit.padding_numel < world * widest_row
        assert unit.padding_share < 0.005
        root = unit_padding("root", llama_root_shapes(), world, 2)
        assert root.padding_numel < world * 4096 + world
