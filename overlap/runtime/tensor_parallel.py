"""ZeRO-3 over one mesh dimension of a model that torch's tensor parallelism split over another.

[Note: tensor-parallel parameters in flat shards]
After `parallelize_module(model, mesh["tp"], plan)` the TP-split parameters are DTensors on the
tp mesh whose local tensor is this rank's TP shard. `ShardedModule(model, mesh=mesh["dp"])`
shards each rank's TP-local tensors over dp exactly as it shards a plain model's parameters:
the module's parameters become plain tensors of the TP-local shape (`take_tensor_parallel`),
laid out in the row-aligned flat groups, gathered and freed per unit over dp. What a unit's
modules compute with is the gathered view wrapped back as a DTensor of the parameter's global
shape and TP placements (`TensorParallelSpec.wrap`: `DTensor.from_local`, no communication),
so TP's own collectives run in forward and backward unchanged, and the gradient DTensor
reaches the flat gradient as this rank's TP-local gradient: the reduce-scatter runs over dp
only (TP's partial sums are redistributed by DTensor's own backward).

Outside forward a parameter is a plain tensor holding this rank's dp rows of its TP-local
shard, as with one mesh dimension: torch's optimizers step it as they are. Its published
gradient's norms combine over the ranks holding parts of it ([Note: norms of sharded
gradients]): over dp for a parameter replicated over tp, over dp and tp for a TP-split one
(`NormGroup`), so `torch.nn.utils.clip_grad_norm_` gives one process's total norm. The
module's DTensor Parameter objects cannot keep their identity (a DTensor cannot be swapped
for a plain tensor), so an optimizer built before wrapping is refused when it steps.

Supported: the dp and tp dimensions span every rank (a ("dp", "tp") mesh over the world, or
("replicate", "shard", "tp") for hybrid sharding over mesh["replicate", "shard"]), Shard and
Replicate placements. What is not made to work here is refused at wrap by
`tensor_parallel_error`, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from overlap.base.config import Config
from overlap.runtime.optimizer_link import OptimizerLink


@dataclass(frozen=True)
class NormGroup:
    """The ranks a TP-split parameter's gradient norm is combined over (what `ShardGrad` reads
    of its collectives: the group and the device the reduction runs on)."""

    group: dist.ProcessGroup
    device: torch.device


@dataclass(frozen=True)
class TensorParallelSpec:
    """How one parameter is split over the tp mesh."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size                 # the global shape
    stride: tuple[int, ...]
    offset: tuple[int, ...]           # where this rank's TP-local tensor starts in the global one
    norm_group: Optional[NormGroup]   # None: replicated over tp, its norm is dp's
    # The mesh the dp mesh was sliced from (the tp mesh's own root can be another model's: torch
    # reuses meshes that compare equal), for the state dict's (tp, dp) mesh.
    root: DeviceMesh

    def wrap(self, local: torch.Tensor) -> DTensor:
        """`local` (a view of the gathered TP-local tensor, or state shaped like it) as a DTensor
        of the global shape: what the module computes with."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)

    def local_block(self, value: torch.Tensor, local_shape: torch.Size) -> torch.Tensor:
        """This rank's TP-local block (of `local_shape`) of `value`, a tensor of the global shape."""
        return value[tuple(slice(start, start + size) for start, size in zip(self.offset, local_shape))]


@dataclass(frozen=True)
class TensorParallel:
    """The tp mesh and each parameter's split, by id of the plain parameter that replaced it."""

    mesh: DeviceMesh
    specs: dict[int, TensorParallelSpec]

    def spec_of(self, param: torch.Tensor) -> Optional[TensorParallelSpec]:
        return self.specs.get(id(param))


def _dtensor_params(module: nn.Module) -> list[tuple[str, DTensor]]:
    return [(name, p) for name, p in module.named_parameters() if isinstance(p, DTensor)]


def tensor_parallel_error(module: nn.Module, mesh: Optional[DeviceMesh], process_group: Optional[dist.ProcessGroup],
                          config: Config) -> Optional[str]:
    """What this rank cannot shard of a model with DTensor parameters, checked without
    communicating (so every rank reports it), or None (also for a model without them)."""
    params = _dtensor_params(module)
    if not params:
        return None
    name, first = params[0]
    tp_mesh = first.device_mesh
    prefix = "tensor parallelism: "
    for other_name, param in params:
        if param.device_mesh != tp_mesh:
            return f"{prefix}parameters {name!r} and {other_name!r} are DTensors on different meshes; " \
                   "parallelize the whole model over one tp mesh"
        bad = [p for p in param.placements if not isinstance(p, (Shard, Replicate))]
        if bad:
            return f"{prefix}parameter {other_name!r} has placement {bad[0]}; only Shard and Replicate are supported"
        if param.is_meta:
            return f"{prefix}parameter {other_name!r} is on the meta device; build the model on a real device " \
                   "before parallelize_module (a meta model's initialisation would see TP-local shapes)"
    if tp_mesh.ndim != 1:
        return f"{prefix}the parameters are DTensors on a {tp_mesh.ndim}-D mesh; parallelize over a 1-D tp mesh " \
               "(mesh['tp'] of a ('dp', 'tp') mesh)"
    if process_group is not None or mesh is None:
        return f"{prefix}pass the data-parallel dimension as mesh=mesh['dp'] (the parameters are split over " \
               f"{tp_mesh.size()} tp ranks, which must not share shards)"
    if mesh.ndim > 2:
        return f"{prefix}a {mesh.ndim}-D data-parallel mesh; pass mesh['dp'] (1-D) or mesh['replicate', 'shard']"
    dp_ranks = set(mesh.mesh.flatten().tolist())
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    # Every rank, or one pipeline stage's ranks: a (pp, dp, tp) mesh's mesh['dp'] and mesh['tp'].
    # Only a dimension named 'pp' may stand outside the plane: any other (replicas of a hybrid
    # mesh) would leave ranks training apart without a word.
    outside = set(mesh._get_root_mesh().mesh_dim_names or ()) - set(mesh.mesh_dim_names or ()) \
        - set(tp_mesh.mesh_dim_names or ())
    whole = len(dp_ranks) * len(tp_ranks) == dist.get_world_size()
    if dp_ranks & tp_ranks != {dist.get_rank()} or not (whole or outside == {"pp"}):
        return f"{prefix}the dp mesh (ranks {sorted(dp_ranks)}) and the tp mesh (ranks {sorted(tp_ranks)}) must be " \
               "two dimensions of one mesh: init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), " \
               "or (pp, dp, tp) with mesh_dim_names=('pp', 'dp', 'tp')"
    refused = [(config.offload == "disk", "offload='disk'"),
               (config.sharding not in ("full", "auto"),
                f"sharding={config.sharding!r} (its groups span every rank, across the tp ranks; for hybrid sharding "
                "pass mesh=mesh['replicate', 'shard'] of a ('replicate', 'shard', 'tp') mesh)")]
    for wanted, what in refused:
        if wanted:
            return f"{prefix}{what} is not supported with tensor-parallel parameters; wrap without it"
    return None


def take_tensor_parallel(module: nn.Module, mesh: Optional[DeviceMesh], device: torch.device, link: OptimizerLink
                         ) -> Optional[TensorParallel]:
    """Replace `module`'s DTensor parameters by plain parameters holding their local tensors
    (a tied one once) and make every parameter replicated over tp hold tp rank 0's values
    (collective over every rank); None when the model has no DTensor parameters. `mesh` is
    the data-parallel one ShardedModule was given, checked by `tensor_parallel_error`. The
    replaced DTensors are refused to optimizers through `link`. See [Note: tensor-parallel
    parameters in flat shards]."""
    params = _dtensor_params(module)
    if not params:
        return None
    tp_mesh = params[0][1].device_mesh
    assert mesh is not None, "tensor_parallel_error lets no tensor-parallel model through without a mesh"
    shard_group = mesh.get_group(mesh.ndim - 1)          # (replicate, shard): the shard dimension
    norm_group = NormGroup(_shard_and_tp_group(shard_group, tp_mesh), device)
    replaced: dict[int, nn.Parameter] = {}
    specs: dict[int, TensorParallelSpec] = {}
    for sub in module.modules():
        for attr, param in list(sub._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            if id(param) not in replaced:
                plain = nn.Parameter(param.to_local().detach().contiguous(), requires_grad=param.requires_grad)
                _, offset = compute_local_shape_and_global_offset(param.shape, tp_mesh, param.placements)
                sharded = any(isinstance(p, Shard) for p in param.placements)
                specs[id(plain)] = TensorParallelSpec(tp_mesh, tuple(param.placements), param.shape, param.stride(),
                                                      tuple(offset), norm_group if sharded else None,
                                                      mesh._get_root_mesh())
                replaced[id(param)] = plain
            sub._parameters[attr] = replaced[id(param)]
    _broadcast_replicated(module, specs, tp_mesh)
    link.add_replaced(param for _, param in params)
    return TensorParallel(tp_mesh, specs)


def _shard_and_tp_group(shard_group: dist.ProcessGroup, tp_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The ranks holding parts of one TP-split parameter: this rank's shard group times its tp
    group (every rank without replicas; with hybrid sharding, one replica's ranks). Made on
    every rank, one group per replica in the same order (collective)."""
    if dist.get_world_size(shard_group) * tp_mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    mine = (tuple(dist.get_process_group_ranks(shard_group)), tuple(tp_mesh.mesh.flatten().tolist()))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shard_of = {rank: shard for rank, (shard, _) in enumerate(everyone)}
    planes = sorted({tuple(sorted(r for t in tp for r in shard_of[t])) for _, tp in everyone})
    groups = {plane: dist.new_group(list(plane)) for plane in planes}
    return groups[tuple(sorted(r for t in mine[1] for r in shard_of[t]))]


def _broadcast_replicated(module: nn.Module, specs: dict[int, TensorParallelSpec], tp_mesh: DeviceMesh) -> None:
    """Parameters the plan left whole (norms, embeddings) or replicated start from tp rank 0's
    values on every tp rank, as the TP-split ones (distributed from tp rank 0) do."""
    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for param in module.parameters():
            spec = specs.get(id(param))
            if spec is None or spec.norm_group is None:
                dist.broadcast(param.data, src=source, group=group)
