"""Which units stay gathered across a step's microbatches (overlap.plan.microbatch_keep)."""
from __future__ import annotations

import pytest

from overlap.base.config import config_from_env
from overlap.plan.microbatch_keep import units_to_keep

MB = 2**20


def test_every_unit_is_kept_when_all_fit_the_budget_or_there_is_none() -> None:
    assert units_to_keep([3 * MB, 5 * MB, 2 * MB], 10 * MB, prefetch_depth=2) == 3
    assert units_to_keep([3 * MB, 5 * MB, 2 * MB], None, prefetch_depth=2) == 3
    assert units_to_keep([], 1, prefetch_depth=1) == 0


def test_the_first_units_are_kept_leaving_room_for_the_rest_in_flight() -> None:
    sizes = [4 * MB] * 6
    # Depth 1: the computing unit and one prefetched, 8 MB, beside the kept ones.
    assert units_to_keep(sizes, 20 * MB, prefetch_depth=1) == 3
    assert units_to_keep(sizes, 23 * MB, prefetch_depth=1) == 3
    assert units_to_keep(sizes, 16 * MB, prefetch_depth=2) == 1
    # The room counts the largest of the units not kept.
    assert units_to_keep([1 * MB, 1 * MB, 1 * MB, 10 * MB], 12.5 * MB, prefetch_depth=0) == 2
    # Not even the units in flight fit: none kept (prefetch's own budget check takes over).
    assert units_to_keep(sizes, 6 * MB, prefetch_depth=1) == 0


def test_the_users_count_wins_within_the_units() -> None:
    sizes = [4 * MB] * 6
    assert units_to_keep(sizes, 1 * MB, prefetch_depth=1, wanted=5) == 5
    assert units_to_keep(sizes, None, prefetch_depth=1, wanted=0) == 0
    assert units_to_keep(sizes, None, prefetch_depth=1, wanted=60) == 6


def test_overlap_keep_units_is_read_and_checked() -> None:
    assert config_from_env({"OVERLAP_KEEP_UNITS": "3"}).keep_units == 3
    assert config_from_env({"OVERLAP_KEEP_UNITS": "auto"}).keep_units is None
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match="OVERLAP_KEEP_UNITS"):
            config_from_env({"OVERLAP_KEEP_UNITS": bad})
