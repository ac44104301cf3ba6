"""The flat layout: how a unit's parameters become flat groups and where each element of a
group lives on each rank. The runtime builds its flat buffers by it
(`overlap.runtime.flat_group`) and the memory prediction counts them by it
(`overlap.plan.memory_prediction`), so the two cannot disagree on a byte of padding.

A unit's parameters form one group per (dtype, requires_grad), in the order each kind first
appears. A group's parameters are laid out in order, each contiguous, in one buffer of
`padded_numel = world * shard_numel` elements; rank r keeps elements [r * shard_numel,
(r + 1) * shard_numel).

[Note: row-aligned shards]
Every shard boundary r * shard_numel that falls inside a parameter falls on a boundary of
its rows (a row: the elements of one index of the first dimension), so each rank keeps a
block of whole rows of each parameter, and its part is a view of the flat shard of shape
(local_rows, *trailing_dims): `p.dim()` and the trailing dimensions are the module's own.
Two kinds of zero padding make that so:
- a gap before a parameter that would cross a boundary in the middle of a row, shifting it
  to the next row boundary (less than one row of that parameter per boundary);
- `shard_numel` itself: above ceil(numel / world) by what the gaps take, and a multiple of
  the row length of every parameter longer than a shard (such a parameter crosses several
  boundaries, which are all row-aligned only if a shard is a whole number of its rows).
The gathered buffer stays contiguous per parameter and every shard has the same size, so
gathers, reductions and compressed collectives work on flat buffers with no copy in or out;
docs/parameters.md compares this with per-parameter DTensors. Parameters of 0 or 1
dimensions have rows of one element and are never shifted; with no parameter of two or more
dimensions the layout is the plain one (padding at the end only).

[Note: offsets aligned to rows, not to 16 bytes]
Offsets and `shard_numel` are aligned to rows only, so with odd sizes (a 1-D parameter of
odd length before a matrix, an odd shard) a 16-bit view can start off a 16-byte boundary:
on CUDA cuBLASLt may pick slower kernels, Inductor copies misaligned inputs and NCCL's
chunks are misaligned. Rounding offsets and shard sizes up to 16 bytes here (where the
planner would price it) waits for a GPU run that shows the cost: it is written, not yet
run on a GPU, and the change would move every offset the flat groups and checkpoints build
on. The GPU check's `parity[odd_shapes_bf16]` trains such a layout.
"""
from __future__ import annotations

import math
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


def row_numel(shape: Sequence[int]) -> int:
    """Elements of one row (one index of the first dimension); 1 below two dimensions, and
    for a parameter with no elements."""
    return max(math.prod(shape[1:]), 1) if len(shape) >= 2 else 1


def _place(numels: Sequence[int], rows: Sequence[int], shard: int) -> tuple[list[int], int]:
    """Offsets that put every shard boundary inside a parameter on one of its row
    boundaries, given shards of `shard` elements (see [Note: row-aligned shards]), and the
    end of the last parameter."""
    offsets, end = [], 0
    for numel, row in zip(numels, rows):
        start = end
        next_boundary = (start // shard + 1) * shard
        if row > 1 and numel > 0 and next_boundary < start + numel:
            start += (next_boundary - start) % row
        offsets.append(start)
        end = start + numel
    return offsets, end


def _solve(numels: Sequence[int], rows: Sequence[int], world: int) -> tuple[int, list[int]]:
    """The smallest shard size this search finds (from ceil(numel / world) up) at which the
    row-aligned placement fits in `world` shards, and the offsets."""
    shard = -(-max(sum(numels), 1) // world)
    while True:
        # Parameters longer than a shard cross several boundaries: a shard must be a whole
        # number of their rows.
        multiple = math.lcm(1, *(row for numel, row in zip(numels, rows) if numel > shard))
        shard = -(-shard // multiple) * multiple
        offsets, end = _place(numels, rows, shard)
        if end <= world * shard:
            return shard, offsets
        shard = max(shard + 1, -(-end // world))


@dataclass(frozen=True)
class FlatLayout:
    """One group of parameters of `numels` elements each, sharded over `world` ranks;
    `rows[i]` is the element count of one row of parameter i (1 for every parameter when
    not given). `FlatLayout.of(shapes, world)` builds it from shapes."""

    numels: tuple[int, ...]
    world: int
    rows: tuple[int, ...] = ()

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], world: int) -> "FlatLayout":
        return cls(tuple(math.prod(shape) for shape in shapes), world, tuple(row_numel(shape) for shape in shapes))

    @cached_property
    def _solution(self) -> tuple[int, tuple[int, ...]]:
        rows = self.rows or (1,) * len(self.numels)
        shard, offsets = _solve(self.numels, rows, self.world)
        return shard, tuple(offsets)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer."""
        return self._solution[1]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return self._solution[0]

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def padding_numel(self) -> int:
        """Zero elements of the gathered buffer: gaps before parameters and the tail."""
        return self.padded_numel - self.numel

    @property
    def split_sizes(self) -> list[int]:
        """Each parameter's length followed by the padding after it (up to the next parameter,
        or to the end): `torch.split` of the flat buffer, whose even pieces are the parameters."""
        ends = [*self.offsets[1:], self.padded_numel]
        return [size for offset, numel, end in zip(self.offsets, self.numels, ends)
                for size in (numel, end - offset - numel)] or [self.padded_numel]

    def part_on(self, index: int, rank: int) -> tuple[int, int]:
        """The element range [start, end) of flattened parameter `index` that `rank` keeps
        (empty, start == end, when the rank's shard misses the parameter): whole rows."""
        offset, numel = self.offsets[index], self.numels[index]
        shard_start = rank * self.shard_numel
        start = min(max(shard_start - offset, 0), numel)
        end = max(min(shard_start + self.shard_numel - offset, numel), start)
        return start, end

    def parts_on(self, rank: int) -> list[tuple[int, int]]:
        """`part_on` of every parameter, in order."""
        return [self.part_on(index, rank) for index in range(len(self.numels))]

    def local_shape(self, index: int, rank: int, shape: Sequence[int]) -> torch.Size:
        """The shape of `rank`'s part of parameter `index` (of full `shape`): its block of
        rows with the trailing dimensions intact; 1-D for a 0-dim parameter (one element on
        the rank that keeps it, none elsewhere)."""
        start, end = self.part_on(index, rank)
        if len(shape) == 0:
            return torch.Size([end - start])
        return torch.Size([(end - start) // row_numel(shape), *shape[1:]])

    def first_row(self, index: int, rank: int, shape: Sequence[int]) -> int:
        """The index along dimension 0 where `rank`'s part of parameter `index` starts."""
        return self.part_on(index, rank)[0] // row_numel(shape) if len(shape) else 0

    def held_numel(self, rank: int) -> int:
        """Parameter elements (the padding left out) in `rank`'s shard."""
        return sum(end - start for start, end in self.parts_on(rank))
