"""Sets of time intervals on one clock: union, difference, length and overlap."""
from __future__ import annotations

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
    out: list[Interval] = []
    for start, end in union(intervals):
        for hole_start, hole_end in cut:
            if hole_end <= start or hole_start >= end:
                continue
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
