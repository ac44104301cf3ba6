"""What each rank resolves on its own at start-up, before any collective: the device the shards
live on, the settings (argument > OVERLAP_* variable > planner), the kernel backend, and
what is wrong with any of them, kept as text so that every rank can report it
(`overlap.control.agreement.check_ranks_agree`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from overlap.base.config import (Config, config_from_env, local_rank_from_env, local_world_size_from_env,
                                 validate_bucket_mb, validate_compress, validate_flag, validate_offload,
                                 validate_prefetch_depth, validate_sharding)
from overlap.base.mixed_precision import MixedPrecision
from overlap.kernels.backends import BackendUnavailable, KernelBackend, get_backend
from overlap.runtime.disk_tier import disk_offload_error
from overlap.runtime.host_tier import offload_error
from overlap.runtime.expert_parallel import expert_parallel_error
from overlap.runtime.mesh import sharding_error
from overlap.runtime.process_group import device_backend


@dataclass(frozen=True)
class StartupRequest:
    """`ShardedModule`'s arguments as the user gave them (see its docstring)."""

    unit_types: Optional[Sequence[type]] = None
    process_group: Optional[dist.ProcessGroup] = None
    mixed_precision: Optional[MixedPrecision] = None
    # Floating-point forward inputs cast to the compute dtype at each unit (FSDP2's
    # `MixedPrecisionPolicy.cast_forward_inputs`; `ShardedModule` always casts).
    cast_forward_inputs: bool = True
    prefetch_depth: Optional[int] = None
    bucket_mb: Optional[float] = None
    reshard_after_forward: bool = True
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    mesh: Optional[DeviceMesh] = None
    sharding: Optional[str] = None
    compression: Optional[str] = None
    compile: Optional[bool] = None
    offload: Optional[str] = None
    nested: bool = False                 # the module already contains a ShardedModule
    # `fully_shard`: each group of modules is a unit, and the modules hold DTensor parameters
    # (FSDP2's form) instead of their own Parameter objects. With `unit_merge_key`, consecutive
    # units whose first modules give equal keys are merged into buckets as the automatic
    # policy's are (fully_shard: by each call's reshard_after_forward); without, none are.
    unit_modules: Optional[tuple[tuple[nn.Module, ...], ...]] = None
    unit_merge_key: Optional[Callable[[nn.Module], Hashable]] = None
    dtensor_params: bool = False
    # A pipeline stage (a mesh with a 'pp' dimension): gathered parameters as one leaf each;
    # see [Note: a pipeline stage's parameters as leaves] in overlap/runtime/flat_group.py.
    stage: bool = False
    # fully_shard: a unit's own mixed precision, from its first module (FSDP2's per-call
    # `mp_policy`); `mixed_precision` is the root's, and the model's where this is None.
    unit_mixed_precision: Optional[Callable[[nn.Module], MixedPrecision]] = None
    # Parameters left out of every unit, as they are (FSDP2's `ignored_params`): never
    # sharded, moved, gathered or reduced; their gradients stay this rank's own.
    ignored_params: tuple[nn.Parameter, ...] = ()
    # fully_shard's `shard_placement_fn`: each parameter sharded on a dimension other than its
    # first, by id, that dimension (see [Note: sharding another dimension] in flat_group.py).
    shard_dims: Optional[Mapping[int, int]] = None
    # sharding="hpz": the node-local copy over this many consecutive ranks instead of
    # LOCAL_WORLD_SIZE's (FSDP2's int `reshard_after_forward`, the group resharded to).
    node_copy_ranks: Optional[int] = None
    # Give a meta-device model's parameters values at wrap (else they start at zero, for the
    # user's own `to_empty()` and initialisation after wrapping, as with FSDP2).
    initialise_meta: bool = True
    # Expert parallelism: ranks per expert-parallel group, and expert module classes to
    # recognise besides the known ones (overlap.runtime.expert_parallel).
    expert_parallel: Optional[int] = None
    expert_types: tuple[type, ...] = ()
    # Pairs each expert module takes per forward, as a multiple of an even share (None:
    # dropless); see [Note: expert capacity] in overlap/base/expert_capacity.py.
    expert_capacity_factor: Optional[float] = None

    # Every rank taking part, where neither the process group nor the world is it: a 1-D
    # mesh's ranks (a pipeline stage's data-parallel ranks; see `for_module`).
    participants: Optional[dist.ProcessGroup] = None

    @property
    def all_group(self) -> dist.ProcessGroup:
        """Every rank taking part: the process group, the participants, or the world."""
        if self.process_group is not None:
            return self.process_group
        return self.participants if self.participants is not None else dist.group.WORLD

    def for_module(self, module: nn.Module) -> "StartupRequest":
        """This request with its participants set: a 1-D mesh shards over its own ranks, which
        are all that take part (several stages of a pipeline wrap different models on
        different ranks); a model split by tensor parallelism spans the tp ranks too: the world,
        or the stage's (dp, tp) plane of a (pp, dp, tp) mesh."""
        if self.process_group is not None or self.mesh is None or self.mesh.ndim != 1 or \
                self.participants is not None:
            return self
        tp_mesh = next((param.device_mesh for param in module.parameters() if isinstance(param, DTensor)), None)
        if tp_mesh is None:
            return dataclasses.replace(self, participants=self.mesh.get_group())
        return dataclasses.replace(self, participants=_dp_tp_plane(self.mesh, tp_mesh))


def _dp_tp_plane(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    """The ranks of the (dp, tp) plane holding this rank, where the two meshes are dimensions
    of a larger mesh (a pipeline stage's of ('pp', 'dp', 'tp')); None where they make up the
    whole mesh (every rank takes part) or are not named dimensions of one. Collective over
    every rank: each plane's group is made on all of them."""
    root = dp_mesh._get_root_mesh()
    names = root.mesh_dim_names or ()
    dp_name = (dp_mesh.mesh_dim_names or (None,))[0]
    tp_name = (tp_mesh.mesh_dim_names or (None,))[0]
    if root.ndim <= 2 or dp_name not in names or tp_name not in names:
        return None
    plane = root[tuple(name for name in names if name in (dp_name, tp_name))]
    return plane._flatten().get_group()


@dataclass(frozen=True)
class RankSettings:
    """One rank's view before the ranks agree; `error` is None when nothing is wrong."""

    device: torch.device
    config: Config
    local_world_size: Optional[int]
    kernels: Optional[KernelBackend]
    error: Optional[str]


def device_for(group: dist.ProcessGroup) -> torch.device:
    """Where shards and gathered buffers live: CUDA when the group runs CUDA tensors on NCCL
    (`init_process_group()` on a GPU machine, "nccl", "cpu:gloo,cuda:nccl"), else the CPU.

    The CUDA device is the one the group is bound to (`init_process_group(device_id=...)`),
    else the current one, which must be LOCAL_RANK's when the launcher set it: a missing
    `torch.cuda.set_device(local_rank)` would otherwise put every rank on GPU 0.
    """
    if device_backend(group, "cuda") != "nccl" or not torch.cuda.is_available():
        return torch.device("cpu")
    bound = group.bound_device_id
    if bound is not None:
        return torch.device("cuda", torch.cuda.current_device() if bound.index is None else bound.index)
    index = torch.cuda.current_device()
    local_rank = local_rank_from_env()
    if local_rank is not None and local_rank < torch.cuda.device_count() and local_rank != index:
        raise ValueError(f"ShardedModule: rank {dist.get_rank()}: the current CUDA device is cuda:{index} but "
                         f"LOCAL_RANK is {local_rank}; call torch.cuda.set_device({local_rank}) before wrapping, "
                         "or pass device_id to init_process_group")
    return torch.device("cuda", index)


def resolve_settings(request: StartupRequest) -> RankSettings:
    """This rank's device, settings and kernels; a bad value becomes `error`, not an exception."""
    device, config, local_world_size, kernels, error = torch.device("cpu"), Config(), None, None, None
    try:
        # The launcher's LOCAL_RANK is read on CUDA only (device_for), but garbage in it is a
        # broken launch on any device, reported by every rank like any other bad setting.
        local_rank_from_env()
        device = device_for(request.all_group)
        validate_flag(request.reshard_after_forward, "reshard_after_forward")
        config = config_from_env().with_overrides(
            prefetch_depth=None if request.prefetch_depth is None else validate_prefetch_depth(request.prefetch_depth),
            bucket_mb=None if request.bucket_mb is None else validate_bucket_mb(request.bucket_mb),
            sharding=None if request.sharding is None else validate_sharding(request.sharding),
            compress=None if request.compression is None else validate_compress(request.compression),
            compile=None if request.compile is None else validate_flag(request.compile, "compile"),
            offload=None if request.offload is None else validate_offload(request.offload))
        local_world_size = local_world_size_from_env()
        error = (sharding_error(request.process_group, request.mesh, config.sharding,
                                request.node_copy_ranks or local_world_size, request.node_copy_ranks)
                 or offload_error(config.offload)
                 or disk_offload_error(config, request.mixed_precision, device)
                 or expert_parallel_error(request.expert_parallel, config, request))
        kernels = get_backend(config.kernels, device)
    except (ValueError, BackendUnavailable) as exc:
        error = str(exc)
    if request.nested:
        error = ("the module already contains a ShardedModule; wrap the model once, at its root, "
                 "and choose units with unit_types")
    return RankSettings(device, config, local_world_size, kernels, error)
