"""This rank's parts of the original parameters (and of their optimizer state) as
`ShardedTensor`s with the parameters' true shapes, the form `torch.distributed.checkpoint`
saves and reshards.

A rank keeps a contiguous run of each flattened parameter (see [Note: original parameters
are views of the flat shard]). A contiguous run of a row-major tensor is a union of at most
2·ndim - 1 rectangular blocks (a partial row, full rows, a partial row, recursively), so
each part becomes a few local shards of a `ShardedTensor` whose global shape is the
parameter's own. A checkpoint written this way names and shapes every tensor as the plain
model does, and loading it at another world size or bucket size is DCP's ordinary
overlap-of-chunks resharding.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

# torch marks ShardedTensor deprecated in favour of DTensor, and DCP's own planners warn
# whenever they touch one. DTensor has no placement for a contiguous run of a flattened
# tensor, which is what each rank holds here; DCP still saves and reshards ShardedTensors,
# so the warning is silenced for that message alone.
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                        category=FutureWarning)

Block = tuple[list[int], list[int]]          # (offsets, sizes) in the full tensor


def contiguous_blocks(shape: Sequence[int], start: int, end: int) -> list[Block]:
    """Rectangular blocks covering elements [start, end) of a row-major tensor of `shape`,
    in element order; each block's elements are one contiguous run of that range."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [([start], [end - start])]
    row = math.prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:
        return [([first, *offsets], [1, *sizes])
                for offsets, sizes in contiguous_blocks(shape[1:], start - first * row, end - first * row)]
    blocks: list[Block] = []
    if start % row:
        blocks += contiguous_blocks(shape, start, (first + 1) * row)
        first += 1
    whole_end = end // row
    if whole_end > first:
        blocks.append(([first] + [0] * (len(shape) - 1), [whole_end - first, *shape[1:]]))
    if end % row:
        blocks += contiguous_blocks(shape, whole_end * row, end)
    return blocks


def as_sharded_tensor(part: torch.Tensor, shape: Sequence[int], parts: Sequence[tuple[int, int]],
                      group: Optional[dist.ProcessGroup]) -> ShardedTensor:
    """`part` (this rank's elements of a tensor of `shape`, flattened) as a ShardedTensor;
    `parts[r]` is the element range rank r of `group` keeps. Local shards are views of `part`:
    loading into the result writes `part` in place."""
    global_shape = list(shape) or [1]        # a 0-dim parameter is saved as one element
    rank = dist.get_rank(group)
    local_part = part.detach().reshape(-1)
    metadata: list[ShardMetadata] = []
    local: list[Shard] = []
    for group_rank, (start, end) in enumerate(parts):
        placement = f"rank:{dist.get_global_rank(group, group_rank) if group is not None else group_rank}/{part.device}"
        position = 0
        for offsets, sizes in contiguous_blocks(global_shape, start, end):
            shard_metadata = ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=placement)
            metadata.append(shard_metadata)
            count = math.prod(sizes)
            if group_rank == rank:
                local.append(Shard(local_part.narrow(0, position, count).view(sizes), shard_metadata))
            position += count
    properties = TensorProperties(dtype=part.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(metadata, torch.Size(global_shape), properties), process_group=group)
