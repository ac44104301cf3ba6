"""The flat layout: how a unit's parameters become flat groups and where each element of a
group lives on each rank. The runtime builds its flat buffers by it
(`overlap.runtime.flat_group`) and the memory prediction counts them by it
(`overlap.plan.memory_prediction`), so the two cannot disagree on a byte of padding.

A unit's parameters form one group per (dtype, requires_grad), in the order each kind first
appears. A group's parameters are flattened in order into `padded_numel = world *
shard_numel` elements, `shard_numel = ceil(numel / world)` (at least one element, so every
rank holds a shard), zero padding at the end; rank r keeps elements [r * shard_numel,
(r + 1) * shard_numel).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence, TypeVar

import torch

Entry = TypeVar("Entry")


def group_by_kind(entries: Sequence[Entry], param_of: Callable[[Entry], torch.Tensor]
                  ) -> dict[tuple[torch.dtype, bool], list[Entry]]:
    """`entries` split into flat groups, keyed by their parameters' (dtype, requires_grad),
    each group and the groups in order of first appearance."""
    groups: dict[tuple[torch.dtype, bool], list[Entry]] = defaultdict(list)
    for entry in entries:
        param = param_of(entry)
        groups[(param.dtype, param.requires_grad)].append(entry)
    return dict(groups)


@dataclass(frozen=True)
class FlatLayout:
    """One group of parameters of `numels` elements each, sharded over `world` ranks."""

    numels: tuple[int, ...]
    world: int

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer."""
        starts, offset = [], 0
        for numel in self.numels:
            starts.append(offset)
            offset += numel
        return tuple(starts)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return -(-max(self.numel, 1) // self.world)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def split_sizes(self) -> list[int]:
        """Each parameter's length, then the padding's: `torch.split` of the flat buffer."""
        return [*self.numels, self.padded_numel - self.numel]

    def part_on(self, index: int, rank: int) -> tuple[int, int]:
        """The element range [start, end) of flattened parameter `index` that `rank` keeps
        (empty, start == end, when the rank's shard misses the parameter)."""
        offset, numel = self.offsets[index], self.numels[index]
        shard_start = rank * self.shard_numel
        start = min(max(shard_start - offset, 0), numel)
        end = max(min(shard_start + self.shard_numel - offset, numel), start)
        return start, end

    def parts_on(self, rank: int) -> list[tuple[int, int]]:
        """`part_on` of every parameter, in order."""
        return [self.part_on(index, rank) for index in range(len(self.numels))]

    def held_numel(self, rank: int) -> int:
        """Parameter elements (the padding left out) in `rank`'s shard."""
        return sum(end - start for start, end in self.parts_on(rank))
