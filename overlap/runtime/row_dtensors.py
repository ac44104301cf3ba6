"""This rank's parts of the original parameters (and of their optimizer state) as DTensors of
the parameters' full shapes: the form FSDP2's state dicts take, and the one
`torch.distributed.checkpoint` (DCP) saves, loads in place and reshards.

A rank keeps a block of whole rows of each parameter, from row `first_row` on (see [Note:
row-aligned shards]). DTensor's `Shard(0)` alone would place rows by even chunks
(`torch.chunk`), which row-aligned shards are in general not, so the local tensor is wrapped
in torch's `LocalShardsWrapper`, which gives DCP the block's own offset: DCP writes and reads
each rank's block where it is and reshards between any two layouts (FSDP2's even chunks,
another world size) by overlapping chunks. These DTensors are for checkpoints: operations
that redistribute (`full_tensor()`, arithmetic across ranks) assume even chunks;
`ShardedModule.full_state_dict()` gives full tensors.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper


@lru_cache(maxsize=None)
def shard_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D mesh over a sharding group (one per group, made once)."""
    return DeviceMesh.from_group(group, device_type)


def as_dtensor(part: torch.Tensor, shape: Sequence[int], first_row: int, mesh: DeviceMesh) -> DTensor:
    """`part` (this rank's rows of a tensor of `shape`, from `first_row`; any shape with that
    many elements) as a DTensor of `shape` whose local tensor is a view of `part`: loading
    into the result writes `part` in place. A 0-dim tensor is one element, shape [1]."""
    trailing = list(shape)[1:]
    return as_block_dtensor(part, shape, trailing, (first_row, *(0 for _ in trailing)), mesh)


def as_block_dtensor(part: torch.Tensor, shape: Sequence[int], trailing: Sequence[int], offset: Sequence[int],
                     mesh: DeviceMesh) -> DTensor:
    """`part` (a block of whole rows of `trailing` trailing dimensions, starting at `offset` in
    a tensor of `shape`) as a DTensor of `shape` whose local tensor is a view of `part`. A
    tensor-parallel parameter's block is this rank's rows of its TP-local tensor, placed at its
    TP offset ([Note: tensor-parallel parameters in flat shards])."""
    global_shape = torch.Size(list(shape) or [1])
    local = part.detach().view(-1, *trailing)
    wrapped = LocalShardsWrapper([local], [tuple(offset)])
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(wrapped, mesh, [Shard(0)], run_check=False, shape=global_shape, stride=stride)


def local_part(value: DTensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local block of a DTensor from `as_dtensor` (or an evenly sharded one) and its offset."""
    local = value.to_local()
    if isinstance(local, LocalShardsWrapper):
        (block,) = local.local_shards()
        return block, tuple(local.local_offsets()[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return local, tuple(offset)


def copy_to_cpu(value: DTensor) -> DTensor:
    """A DTensor like `value` (from `as_dtensor`) over a CPU copy of its local rows."""
    block, offset = local_part(value)
    return as_block_dtensor(block.detach().to("cpu", copy=True), value.shape, block.shape[1:], offset or (0,),
                            value.device_mesh)
