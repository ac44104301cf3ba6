"""How many units stay gathered across a step's microbatches (a pipeline schedule, whose
passes of one step all compute with the same weights).

A kept unit is gathered once per step; the others are gathered again for each microbatch's
forward and backward. Keeping every unit moves the fewest bytes and holds the whole stage
gathered, as FSDP2 does under pipelining without resharding. Under a memory budget the
first units in forward order are kept (those the first microbatch needs first), and room is
left for the units that are still gathered per microbatch: the computing one and the ones
prefetched behind it, counted at the largest such unit's size.
"""
from __future__ import annotations

from typing import Optional, Sequence


def units_to_keep(gathered_bytes: Sequence[int], memory_budget_bytes: Optional[int], prefetch_depth: int,
                  wanted: Optional[int] = None) -> int:
    """The number of leading units (in forward order, `gathered_bytes` each) to keep gathered:
    `wanted` when the user set it, else as many as fit the budget."""
    count = len(gathered_bytes)
    if wanted is not None:
        return min(max(wanted, 0), count)
    if memory_budget_bytes is None or sum(gathered_bytes) <= memory_budget_bytes:
        return count
    for kept in range(count - 1, -1, -1):
        rest = sorted(gathered_bytes[kept:], reverse=True)
        in_flight = sum(rest[:prefetch_depth + 1])
        if sum(gathered_bytes[:kept]) + in_flight <= memory_budget_bytes:
            return kept
    return 0
