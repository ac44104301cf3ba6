"""Expert parameters as DTensors of every expert: the form their state dicts, `torch.distributed.
checkpoint` and torch's state-dict API take under expert parallelism.

[Note: expert parameters in state dicts]
Under expert parallelism a rank's expert parameter holds its rows of its own experts: rank
r = g·E + e keeps experts [e·n/E, (e+1)·n/E) of n, and of those the rows its expert-sharding
group's flat layout gives it (see [Note: expert parallelism's groups]). As a DTensor that is
two shardings of the expert dimension, one after the other, on the 2-D mesh (ep, efsdp) made
of the two families of groups: `Shard(0)` over ep (E even chunks of n/E experts, as
`torch.chunk` cuts them), then `RowShard(0, rows)` over efsdp (each rank's rows of its
experts, as the non-expert parameters' over the whole world). DTensor nests two shardings of
one dimension in mesh order, so each rank's block sits at its expert offset plus its row
offset inside its experts: what DCP writes it under, and what DTensor's own collectives
(`full_tensor()`, torch's full state dicts) gather. A checkpoint so written holds every
expert once at its global place, so it loads at another expert-parallel size, without expert
parallelism, or into one process. The local tensor is the same view of the flat shard as
without expert parallelism, so loading writes the shard in place.
"""
from __future__ import annotations

from functools import lru_cache

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from overlap.runtime.expert_parallel import ExpertGroups
from overlap.runtime.row_dtensors import RowDTensor, RowShard, combine_norms_over, row_dtensor, shard_mesh


@lru_cache(maxsize=None)
def expert_mesh(groups: ExpertGroups, device_type: str) -> DeviceMesh:
    """The (ep, efsdp) mesh over this rank's expert-parallel and expert-sharding groups (one
    per set of groups, made once; local: no group is made)."""
    # mesh[e][g] is rank g·E + e: row e the expert-sharding group e, column g the
    # expert-parallel group g, each listing its members as make_groups does.
    plane = [[groups.ranks[g * groups.size + e] for g in range(len(groups.ranks) // groups.size)]
             for e in range(groups.size)]
    mesh = DeviceMesh.from_group([groups.ep_groups[0], groups.shard_group], device_type,
                                 mesh=torch.tensor(plane), mesh_dim_names=("ep", "efsdp"))
    # Every element of every expert lies on one rank of the plane, which holds the same ranks
    # as the non-expert parameters' mesh: their norms combine there, so that torch's clip
    # sums every parameter's (see [Note: norms on another mesh]).
    combine_norms_over(mesh, shard_mesh(groups.all_group, device_type))
    return mesh


def experts_shape(local_shape: torch.Size, groups: ExpertGroups) -> torch.Size:
    """The shape of an expert parameter over every expert, from its shape over this rank's."""
    return torch.Size([local_shape[0] * groups.size, *local_shape[1:]])


def expert_dtensor(part: torch.Tensor, local_shape: torch.Size, rows: tuple[int, ...], groups: ExpertGroups,
                   device_type: str, dim: int = 0) -> RowDTensor:
    """`part` (this rank's rows of an expert parameter shaped `local_shape` over this rank's
    experts; each expert-sharding rank's row count in `rows`) as a DTensor of every expert
    whose local tensor is a view of `part` (see the note). With `dim`, the expert-sharding
    group holds rows of that dimension instead (`shard_placement_fn`'s, `part` already in the
    parameter's order: [Note: sharding another dimension] in overlap/runtime/flat_group.py):
    `Shard(0)` over ep, then `RowShard(dim, rows)` over efsdp, as torchtitan shards experts
    that are fewer than their ranks."""
    shape = experts_shape(local_shape, groups)
    local = part.detach() if dim else part.detach().view(-1, *shape[1:])
    return row_dtensor(local, expert_mesh(groups, device_type), [Shard(0), RowShard(dim, rows)], shape)
