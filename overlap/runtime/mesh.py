"""Which ranks share the shards and which hold replicas: full sharding over one process
group, hybrid sharding over a 2-D device mesh (replicate across nodes, shard inside each), or
hpZ (shard over every rank, or a mesh's shard dimension, and keep a copy over a node's ranks,
or over consecutive ranks of that dimension, for backward; see overlap.runtime.node_copy).

With hybrid sharding the frequent all-gathers and reduce-scatters stay on the fast link
inside a node, and only one all-reduce of each rank's gradient shard crosses the slow link
between nodes per step; the price is memory: states are sharded over a node's ranks only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from overlap.runtime.process_group import level_group_counts


@dataclass(frozen=True)
class ShardingGroups:
    shard: dist.ProcessGroup                    # ranks whose shards make up the parameters
    replicate: Optional[dist.ProcessGroup]      # ranks holding the same shard (None: full sharding)
    node: Optional[dist.ProcessGroup] = None    # hpZ: this node's ranks, which gather backward's copy
    # (on a 2-D mesh hpZ runs inside each replica's shard group, and the replicas all-reduce as
    # hybrid sharding's do)

    @property
    def replicas(self) -> int:
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    def describe(self) -> str:
        shard = dist.get_world_size(self.shard)
        if self.node is not None:
            replicas = "" if self.replicate is None else f", {self.replicas} replicas"
            return f"hpZ: full sharding over {shard} ranks, backward gathers over {dist.get_world_size(self.node)} " \
                   f"ranks per node{replicas}"
        return f"full sharding over {shard} ranks" if self.replicate is None else \
            f"hybrid sharding: {shard} ranks per shard group, {self.replicas} replicas"


def connect(group: dist.ProcessGroup, device_type: str) -> None:
    """One all-reduce of one element over `group`, so that its communicator exists now.

    NCCL makes a group's communicator at its first collective. hpZ's node group first
    communicates in backward (the re-gather from the node copy) and hybrid sharding's
    replicate group at the first gradient all-reduce, both on autograd's thread mid-step:
    made there, the communicator's set-up (seconds at scale, a hang if a rank is missing)
    lands inside the first step and its timings. Made here, at start-up, every rank of the
    group is at the same point (collective)."""
    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def copy_group_within(shard: dist.ProcessGroup, copy_ranks: int, device_type: str) -> dist.ProcessGroup:
    """hpZ inside `shard` (a mesh's ranks): the group of `copy_ranks` consecutive ranks of it
    that holds this rank's part of backward's copy. Collective over `shard`; only its ranks
    make the groups, each its own (see [Note: groups made by some ranks only])."""
    ranks = dist.get_process_group_ranks(shard)
    level_group_counts(shard)
    start = ranks.index(dist.get_rank()) // copy_ranks * copy_ranks
    node = dist.new_group(ranks[start:start + copy_ranks], use_local_synchronization=True)
    connect(node, device_type)
    return node


def _from_mesh(mesh: DeviceMesh) -> ShardingGroups:
    if mesh.ndim == 1:
        return ShardingGroups(mesh.get_group(0), None)
    replicate = None if mesh.size(0) == 1 else mesh.get_group(0)
    if replicate is not None:
        connect(replicate, mesh.device_type)
    return ShardingGroups(mesh.get_group(1), replicate)


def sharding_error(process_group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh], sharding: str,
                   local_world_size: Optional[int], copy_ranks: Optional[int] = None) -> Optional[str]:
    """What is wrong with these arguments, checked without communicating (so that every rank
    can report it before any collective), or None. `copy_ranks`: hpZ's copy over groups of
    this many ranks of the mesh (fully_shard's int `reshard_after_forward`)."""
    if mesh is not None:
        if process_group is not None:
            return "pass either process_group or mesh, not both"
        if not isinstance(mesh, DeviceMesh):
            return f"mesh={mesh!r} is not a DeviceMesh; make one with torch.distributed.device_mesh.init_device_mesh"
        if mesh.ndim not in (1, 2):
            return f"mesh has {mesh.ndim} dimensions; expected 1 (shard) or 2 (replicate, shard)"
        names = mesh.mesh_dim_names
        if mesh.ndim == 2 and names is not None and tuple(names) != ("replicate", "shard"):
            return f"mesh dimensions {names}: name them ('replicate', 'shard'), the order FSDP2 uses"
        if sharding == "hpz" and copy_ranks is None:
            return "sharding='hpz' builds its node groups from LOCAL_WORLD_SIZE; pass no mesh"
        if sharding == "hpz" and mesh.size(mesh.ndim - 1) % copy_ranks:
            return f"hpZ's copy over groups of {copy_ranks} ranks needs a mesh whose shard dimension is a multiple " \
                   "of that many ranks"
        return None
    if sharding == "full" or (sharding == "auto" and (process_group is not None or local_world_size is None)):
        return None                             # auto: full sharding over the group, or over one node
    if process_group is not None:
        return f"sharding={sharding!r} builds its groups over every rank; pass a 2-D mesh to use a subgroup"
    if local_world_size is None:
        return f"sharding={sharding!r} needs LOCAL_WORLD_SIZE (set by torchrun)"
    if dist.get_world_size() % local_world_size:
        return f"sharding={sharding!r}: world size {dist.get_world_size()} is not a multiple of LOCAL_WORLD_SIZE " \
               f"{local_world_size}"
    return None


def resolve_sharding(process_group: Optional[dist.ProcessGroup], mesh: Optional[DeviceMesh], sharding: str,
                     local_world_size: Optional[int], device_type: str) -> ShardingGroups:
    """The groups for `ShardedModule`'s arguments (a mesh beats `sharding`, but for hpZ over
    its ranks, which only `fully_shard`'s int asks for), once `sharding_error` has found nothing
    wrong. Building a mesh is collective."""
    if mesh is not None:
        groups = _from_mesh(mesh)
        if sharding != "hpz":
            return groups
        # hpZ on a mesh: `local_world_size` is the copy's group size (fully_shard's int), over
        # consecutive ranks of the shard dimension.
        return dataclasses.replace(groups, node=copy_group_within(groups.shard, local_world_size, device_type))
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size()
    if sharding in ("full", "auto") or local_world_size is None or world == local_world_size:
        return ShardingGroups(group, None)      # one node: nothing to replicate
    return groups_on_mesh(sharding, init_device_mesh(device_type, (world // local_world_size, local_world_size),
                                                     mesh_dim_names=("replicate", "shard")))


def groups_on_mesh(sharding: str, mesh: DeviceMesh) -> ShardingGroups:
    """The groups of "full", "hybrid" or "hpz" sharding over every rank, on a ("replicate",
    "shard") mesh whose second dimension is a node's ranks."""
    node, across = mesh.get_group(1), mesh.get_group(0)
    # hpZ's node group and hybrid's replicate group first communicate mid-backward.
    if sharding in ("hybrid", "hpz"):
        connect(across if sharding == "hybrid" else node, mesh.device_type)
    return {"full": ShardingGroups(dist.group.WORLD, None), "hybrid": ShardingGroups(node, across),
            "hpz": ShardingGroups(dist.group.WORLD, None, node)}[sharding]
