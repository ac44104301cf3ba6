"""The row-aligned flat layout (`overlap.base.layout`): every rank keeps whole rows of every
parameter, the gathered buffer is contiguous per parameter, and the padding stays within a
row per boundary."""
from __future__ import annotations

import math
import random

import pytest

from overlap.base.layout import FlatLayout, row_numel

SHAPES = [
    [(37, 12), (12,), (20, 12), (20,), (12, 20), (12,)],          # a small MLP block
    [(3, 3), (3,), (2, 3), (2,)],                                  # fewer rows than ranks
    [(5,), (1,), (), (7, 2, 3), (4, 5)],                            # 0-, 1- and 3-dim parameters
    [(0, 4), (4, 4), (0,)],                                         # empty parameters
]


def _check(shapes: list[tuple[int, ...]], world: int) -> FlatLayout:
    layout = FlatLayout.of(shapes, world)
    ends = [offset + numel for offset, numel in zip(layout.offsets, layout.numels)]
    assert all(end <= start for end, start in zip(ends, layout.offsets[1:])), "parameters overlap"
    assert (ends[-1] if ends else 0) <= layout.padded_numel
    assert sum(layout.split_sizes) == layout.padded_numel
    assert layout.split_sizes[::2][:len(shapes)] == list(layout.numels)
    for index, shape in enumerate(shapes):
        parts = [layout.part_on(index, rank) for rank in range(world)]
        covered = [i for start, end in parts for i in range(start, end)]
        assert covered == list(range(layout.numels[index])), (shape, parts)
        row = row_numel(shape)
        for rank, (start, end) in enumerate(parts):
            assert start % row == 0 and end % row == 0, (shape, rank, parts)
            local = layout.local_shape(index, rank, shape)
            assert math.prod(local) == end - start
            assert len(local) == max(len(shape), 1) and tuple(local[1:]) == tuple(shape[1:])
    return layout


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("shapes", SHAPES)
def test_every_rank_keeps_whole_rows(shapes, world: int) -> None:
    _check(shapes, world)


def test_random_shapes_keep_whole_rows() -> None:
    rng = random.Random(0)
    for _ in range(200):
        shapes = [tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 8))]
        _check(shapes, rng.randint(1, 9))


def test_one_dimensional_parameters_keep_the_plain_layout() -> None:
    layout = FlatLayout.of([(5,), (0,), (7,), (1,)], 3)
    assert layout == FlatLayout.of([(5,), (0,), (7,), (1,)], 3)
    assert layout.offsets == FlatLayout((5, 0, 7, 1), 3).offsets == (0, 5, 5, 12)
    assert layout.shard_numel == 5 and layout.padding_numel == 2


def test_padding_is_at_most_a_row_per_boundary_when_a_shard_holds_whole_rows() -> None:
    """A transformer block's shapes: ceil(numel / world) rounded up to whole rows of the
    widest matrix, plus gaps of less than a row."""
    d = 64
    shapes = [(d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    for world in (2, 3, 4, 8):
        layout = _check(shapes, world)
        assert layout.padding_numel < world * 4 * d + 4 * d, world
