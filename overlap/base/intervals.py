"""Sets of time intervals on one clock: union, difference, length and overlap."""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Sequence

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same points."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def subtract(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """The parts of `intervals` outside every hole."""
    cut = union(holes)
    cut_ends = [end for _, end in cut]
    out: list[Interval] = []
    for start, end in union(intervals):
        # Holes ending at or before `start` cannot touch this interval or any later one.
        for hole_start, hole_end in cut[bisect_right(cut_ends, start):]:
            if hole_start >= end:
                break
            if hole_start > start:
                out.append((start, hole_start))
            start = max(start, hole_end)
        if end > start:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def overlap(intervals: Sequence[Interval], others: Sequence[Interval]) -> float:
    """Length of the points covered by both."""
    return length(intervals) - length(subtract(intervals, others))


def overlap_each(intervals: Iterable[Interval], covered: Sequence[Interval]) -> float:
    """Sum over `intervals`, each on its own, of its length inside `covered` (sorted and
    disjoint, as `union` gives): intervals that overlap one another count each time."""
    starts = [start for start, _ in covered]
    total = 0.0
    for start, end in intervals:
        i = max(bisect_right(starts, start) - 1, 0)
        while i < len(covered) and covered[i][0] < end:
            total += max(0.0, min(covered[i][1], end) - max(covered[i][0], start))
            i += 1
    return total
