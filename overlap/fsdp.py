"""`fully_shard`: FSDP2's entry point, spelled as torch's, over this runtime.

```python
from overlap import fully_shard           # instead of torch.distributed.fsdp's
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
```

Each call marks a module as one unit and makes it an `FSDPModule` (torch's class: code that
checks `isinstance(m, FSDPModule)`, torch's pipelining among it, sees one). The call on a
module that holds marked ones (the root) builds the runtime over all of them at once: one
flat group per unit and dtype, gathered, freed and reduced as `ShardedModule`'s units are.
A module marked alone builds when first used (its forward, its parameters, its state dict).

[Note: DTensor parameters]
Under `fully_shard` the modules hold FSDP2's form of each parameter: a DTensor of the full
shape whose local tensor is this rank's row-aligned view of the flat shard (no copy), under
the `RowShard` placement ([Note: row-aligned shards as a DTensor placement]). So code written
for FSDP2 works as it is: `p.full_tensor()`, `p.to_local()`, `p.device_mesh`, `p.placements`,
`distribute_tensor(full, p.device_mesh, p.placements)` (loaded back through
`load_state_dict`, which takes any sharding of the full shape), `model.state_dict()` for DCP,
torch's clip and GradScaler over DTensor gradients. Optimizers step the DTensors (their state
is DTensors too); forward and backward never see them: units compute with plain views of their
gathered buffers, as under `ShardedModule`. `ShardedModule` keeps the module's own Parameter
objects instead, for scripts written for DDP (an optimizer built before wrapping).

Where FSDP2 lets its user schedule by hand (explicit prefetch lists, `unshard()` ahead of a
forward) the runtime's learned order and planner decide; those calls are kept as hints,
listed in `overlap_report()` and in docs/fully_shard.md. `set_reshard_after_backward(False)`
keeps units gathered across the step's passes, as many as the memory budget allows.

[Note: fully_shard's units in buckets]
Each call's modules are a unit, and consecutive small units are merged into one bucket, as
`ShardedModule`'s are: one all-gather and one reduce-scatter per bucket, up to the planner's
bucket size (`OVERLAP_BUCKET_MB`; one smaller than every unit keeps each call's unit apart,
FSDP2's own granularity). Each collective costs the host a fixed amount whatever its size, so
small blocks gathered one by one cost more than the compute they hide behind. Only units whose
calls asked the same `reshard_after_forward`, `mp_policy` and `set_unshard_in_backward`
(before the model was built) share a bucket, so each keeps what was asked of it. The calls
that name one module (`unshard()`, `reshard()`, `set_reshard_after_forward(recurse=False)`)
act on its whole bucket.
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils._pytree import tree_map_only

from overlap.base.mixed_precision import MixedPrecision
from overlap.control.settings import StartupRequest
from overlap.pipeline_stage import Unsharded, is_stage_mesh, register_grad_step
from overlap.runtime.bound_params import apply_keeping_shards
from overlap.runtime.unit import backward_reads_weights
from overlap.sharded_module import ShardedModule, refused_copy, register_forward_method, strict_load_error

# Kept in each marked module's __dict__ (not as submodules or parameters, so that neither
# shows in its state dict or its module tree).
_MARK = "_overlap_fully_shard"        # this call's arguments
_RUNTIME = "_overlap_runtime"         # the ShardedModule that runs the whole model, once built
_OWNER = "_overlap_owner"             # the marked module this one is inside, for the root's build
_IGNORED = "_overlap_ignored"         # the root's: where the parameters left out of sharding are
_BUILD_HOOK = "_overlap_build_hook"   # the pre-hook that builds the runtime at a first forward
_BUILDING = object()                  # in place of the runtime while it is being built


@dataclasses.dataclass(frozen=True)
class OverlapPolicy:
    """What `fully_shard` takes beyond FSDP2's arguments: `ShardedModule`'s own settings of the
    same names (None leaves each to the planner or its `OVERLAP_*` variable). It is the whole
    model's: give it to the root's call; a block's call may leave it out, or give the same.

    prefetch_depth, bucket_mb: units gathered ahead, and the size units are merged up to.
    compression: the collectives' codec ('none', 'int8', 'int8-int4', 'auto').
    compile: each unit's compute compiled with torch.compile, the runtime's hooks outside.
    expert_parallel, expert_types, expert_capacity_factor: each MoE layer's experts split over
    groups of this many ranks, tokens sent to them by all-to-all (docs/moe.md)."""

    prefetch_depth: Optional[int] = None
    bucket_mb: Optional[float] = None
    compression: Optional[str] = None
    compile: Optional[bool] = None
    expert_parallel: Optional[int] = None
    expert_types: Sequence[type] = ()
    expert_capacity_factor: Optional[float] = None


class _Marked:
    """One `fully_shard` call's arguments, checked."""

    def __init__(self, mesh: Optional[DeviceMesh], reshard_after_forward: Union[bool, int],
                 mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                 overlap_policy: Optional[OverlapPolicy], ignored_params: frozenset[int],
                 shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]]) -> None:
        self.mesh = mesh
        self.ignored_params = ignored_params          # ids
        self.shard_placement_fn = shard_placement_fn
        # FSDPModule.set_unshard_in_backward; None: the runtime's choice (`backward_reads_weights`).
        self.unshard_in_backward: Optional[bool] = None
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy
        self.offload_policy = offload_policy
        self.overlap_policy = overlap_policy

    def same_runtime(self) -> tuple:
        """What every unit of one model must share: one runtime runs them all."""
        mesh = None if self.mesh is None else (tuple(self.mesh.mesh.flatten().tolist()), self.mesh.mesh_dim_names)
        # `mp_policy` is each call's own: its unit's dtypes, its inputs' cast, its outputs' cast.
        return mesh, type(self.offload_policy)

    def mixed_precision(self) -> MixedPrecision:
        """This call's dtypes to gather and reduce in (none given: the parameters' own)."""
        return MixedPrecision(param_dtype=self.mp_policy.param_dtype, reduce_dtype=self.mp_policy.reduce_dtype)

    def input_dtype(self) -> Optional[torch.dtype]:
        """The dtype this call's module casts its floating-point inputs to (None: none)."""
        return self.mp_policy.param_dtype if self.mp_policy.cast_forward_inputs else None


def fully_shard(module: Union[nn.Module, list[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Union[bool, int] = True,
                shard_placement_fn: Optional[Callable[[nn.Parameter], Optional[Shard]]] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(),
                ignored_params: Optional[set[nn.Parameter]] = None,
                overlap_policy: Optional[OverlapPolicy] = None) -> Union[nn.Module, list[nn.Module]]:
    """Shard `module`'s parameters over `mesh` as torch's `fully_shard` does (see the module
    note), and return it, now an `FSDPModule`; a list of modules is one unit. Every rank calls
    it, in the same order: blocks, then the module that holds them. `overlap_policy`: the
    runtime's settings beyond FSDP2's arguments (`OverlapPolicy`), on the root's call."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    for each in modules:
        _check_arguments(each, mesh, reshard_after_forward, shard_placement_fn, mp_policy, offload_policy,
                         ignored_params, overlap_policy)
        if _RUNTIME in each.__dict__:
            raise ValueError(f"fully_shard: {type(each).__name__} is already sharded (its model was built when it "
                             "was first used); call fully_shard on each module once, blocks before their root, "
                             "then use the model")
        if _MARK in each.__dict__:
            raise ValueError(f"fully_shard: {type(each).__name__} was given to fully_shard already; call it once "
                             "per module (a second call's arguments would replace the first's)")
    marked = _Marked(mesh, _resharding(reshard_after_forward, mesh), mp_policy, offload_policy, overlap_policy,
                     frozenset(id(param) for param in ignored_params or ()), shard_placement_fn)
    for each in modules:
        # The marked modules inside become this call's: the outermost call is the root, whose
        # runtime is built when any of them is first used.
        for inner in each.modules():
            if inner is not each and _MARK in inner.__dict__:
                inner.__dict__[_OWNER] = each
        each.__dict__[_MARK] = marked
        each.__class__ = _fsdp_class(type(each))
        each.__dict__[_BUILD_HOOK] = each.register_forward_pre_hook(_build_before_forward, prepend=True,
                                                                     with_kwargs=True)
        if mp_policy.output_dtype is not None:
            each.register_forward_hook(_OutputCast(mp_policy.output_dtype))
    return module


class _OutputCast:
    """A module's floating-point outputs cast to `MixedPrecisionPolicy.output_dtype`, as FSDP2
    casts them after its forward (the module's units compute in `param_dtype` all the same)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return tree_map_only(torch.Tensor, self._cast, output)

    def _cast(self, value: torch.Tensor) -> torch.Tensor:
        return value.to(self.dtype) if value.is_floating_point() else value


def _check_arguments(module: nn.Module, mesh: Optional[DeviceMesh], reshard_after_forward: Union[bool, int],
                     shard_placement_fn: Optional[Callable], mp_policy: MixedPrecisionPolicy,
                     offload_policy: OffloadPolicy, ignored_params: Optional[set],
                     overlap_policy: Optional[OverlapPolicy]) -> None:
    """Refuse what is not supported, by name (every rank calls with the same arguments)."""
    if overlap_policy is not None and not isinstance(overlap_policy, OverlapPolicy):
        raise TypeError(f"fully_shard: overlap_policy must be overlap.OverlapPolicy, got "
                        f"{type(overlap_policy).__name__}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: expected an nn.Module, got {type(module).__name__} (a list of modules as one "
                        "unit is not supported: call fully_shard on the module that holds them)")
    if mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2)):
        raise ValueError(f"fully_shard: mesh must be a 1-D DeviceMesh (shard) or a 2-D one (replicate, shard), got "
                         f"{mesh!r}")
    if not isinstance(reshard_after_forward, int):
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool or an int, got {reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy must be OffloadPolicy() or CPUOffloadPolicy(), got "
                        f"{type(offload_policy).__name__}")
    for param in ignored_params or ():
        if not isinstance(param, nn.Parameter):
            raise TypeError(f"fully_shard: ignored_params must hold nn.Parameter objects, got {type(param).__name__}")
        if isinstance(param, DTensor):
            raise NotImplementedError("fully_shard: ignored_params holds a DTensor parameter (tensor parallel); only "
                                      "plain parameters can be left out of sharding")
    if shard_placement_fn is not None:
        for name, param in _managed_parameters(module):
            dim = _shard_dim(shard_placement_fn, param, name)
            if dim and isinstance(param, DTensor):
                raise NotImplementedError(f"fully_shard: shard_placement_fn gave Shard({dim}) for {name!r}, a DTensor "
                                          "parameter (tensor parallel); those are sharded on dimension 0 only")


def _shard_dim(shard_placement_fn: Callable[[nn.Parameter], Optional[Shard]], param: nn.Parameter, name: str) -> int:
    """The dimension `shard_placement_fn` shards `param` on (None: 0, as FSDP2 takes it),
    negative dimensions counted from the end; refused by name where it is no `Shard` of one
    of the parameter's dimensions."""
    placement = shard_placement_fn(param)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(f"fully_shard: shard_placement_fn gave {placement!r} for {name!r}; it must give a Shard "
                         "placement or None")
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < max(param.dim(), 1):
        raise ValueError(f"fully_shard: shard_placement_fn gave {placement!r} for {name!r}, which has "
                         f"{param.dim()} dimension(s)")
    return dim


def _managed_parameters(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters a `fully_shard` call on `module` shards, by name: its own and those of the
    modules inside it that no earlier call was given (FSDP2 applies each call's
    `shard_placement_fn` to those alone)."""
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param
    for name, child in module._modules.items():
        if child is not None and _MARK not in child.__dict__:
            yield from _managed_parameters(child, f"{prefix}{name}.")


def _shard_dims(root: nn.Module) -> dict[int, int]:
    """Each parameter's sharded dimension where it is not 0, by id: from the `shard_placement_fn`
    of the call that shards it."""
    dims = {}
    for prefix, module in root.named_modules():
        given = module.__dict__[_MARK].shard_placement_fn if _MARK in module.__dict__ else None
        if given is not None:
            for name, param in _managed_parameters(module, f"{prefix}." if prefix else ""):
                dim = _shard_dim(given, param, name)
                if dim:
                    dims[id(param)] = dim
    return dims


def _resharding(reshard_after_forward: Union[bool, int], mesh: Optional[DeviceMesh]) -> Union[bool, int]:
    """`reshard_after_forward` as the runtime takes it: an int k is the size of the groups of
    consecutive ranks a unit is resharded to after forward (FSDP2's meaning): 1 keeps it whole
    (False), the ranks it is sharded over reshard it fully (True), any other divisor keeps a
    copy sharded over k ranks for backward's gather (hpZ over groups of k)."""
    if isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    if not dist.is_initialized():
        raise RuntimeError(f"fully_shard: reshard_after_forward={reshard_after_forward} needs torch.distributed "
                           "initialised first (the int is a size of a group of ranks)")
    world = dist.get_world_size()
    size = world if mesh is None else mesh.size(mesh.ndim - 1)
    if not 1 <= reshard_after_forward <= size or size % reshard_after_forward:
        raise ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward}: an int must divide the {size} "
                         "ranks each parameter is sharded over (the size of the groups it is resharded to after "
                         "forward)")
    if reshard_after_forward in (1, size):
        return reshard_after_forward == size
    return reshard_after_forward


def _unit_groups(members: list[nn.Module]) -> tuple[tuple[nn.Module, ...], ...]:
    """The members grouped by the call that marked them (a list is one unit), in module order."""
    groups: dict[int, list[nn.Module]] = {}
    for member in members:
        groups.setdefault(id(member.__dict__[_MARK]), []).append(member)
    return tuple(tuple(group) for group in groups.values())


def _ignored_places(root: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where the parameters left out of sharding are registered: those given as
    `ignored_params` to the call that would shard them (the call of the nearest marked module
    that holds them), as FSDP2 decides it. Kept as places: `to_empty()` replaces them."""
    calls = _calls_by_module(root)
    return [(module, name) for module in root.modules() for name, param in module._parameters.items()
            if param is not None and id(param) in calls[id(module)].ignored_params]


def _unit_policies(root: nn.Module) -> Callable[[nn.Module], MixedPrecision]:
    """Each unit's mixed precision: its first module's call's `mp_policy`."""
    calls = _calls_by_module(root)
    return lambda module: calls[id(module)].mixed_precision()


def _bucket_key(module: nn.Module) -> tuple:
    """What a unit's call asked of resharding after forward, gathering for backward and mixed
    precision: units are merged into buckets only with neighbours that asked the same ([Note:
    fully_shard's units in buckets])."""
    marked = module.__dict__[_MARK]
    return marked.reshard_after_forward, marked.unshard_in_backward, marked.mixed_precision(), marked.input_dtype()


def _runtime_request(root: nn.Module, members: list[nn.Module]) -> StartupRequest:
    """The runtime's settings from the root's call (every member's must agree with it)."""
    marked = root.__dict__[_MARK]
    for member in members:
        if member.__dict__[_MARK].same_runtime() != marked.same_runtime():
            raise ValueError(f"fully_shard: {type(member).__name__} was given another mesh or offload_policy than "
                             f"its root {type(root).__name__}; one model is sharded with one of each")
    policy = marked.overlap_policy
    for member in members:
        given = member.__dict__[_MARK].overlap_policy
        if given is not None and given != policy:
            raise ValueError(f"fully_shard: {type(member).__name__} was given another overlap_policy than its root "
                             f"{type(root).__name__} ({given} against {policy}); the policy is the whole model's: "
                             "give it to the root's call")
    policy = policy or OverlapPolicy()
    # An int: a copy kept over groups of that many ranks (hpZ), the whole model's.
    given = [m.__dict__[_MARK].reshard_after_forward for m in [root, *members]]
    copies = sorted({value for value in given if not isinstance(value, bool)})
    if len(copies) > 1:
        raise ValueError(f"fully_shard: reshard_after_forward={copies[0]} and {copies[1]} on one model: the copy kept "
                         "after forward has one group size per model")
    return StartupRequest(
        mesh=marked.mesh, mixed_precision=mixed_precision_of(marked.mp_policy),
        unit_mixed_precision=_unit_policies(root),
        cast_forward_inputs=marked.mp_policy.cast_forward_inputs, unit_modules=_unit_groups(members),
        unit_merge_key=_bucket_key,
        dtensor_params=True, stage=is_stage_mesh(marked.mesh),
        ignored_params=tuple(dict.fromkeys(module._parameters[name] for module, name in root.__dict__[_IGNORED])),
        shard_dims=_shard_dims(root),
        initialise_meta=False, sharding="hpz" if copies else None, node_copy_ranks=copies[0] if copies else None,
        offload="cpu" if isinstance(marked.offload_policy, CPUOffloadPolicy) else None,
        prefetch_depth=policy.prefetch_depth, bucket_mb=policy.bucket_mb, compression=policy.compression,
        compile=policy.compile, expert_parallel=policy.expert_parallel, expert_types=tuple(policy.expert_types),
        expert_capacity_factor=policy.expert_capacity_factor)


def _build(root: nn.Module) -> ShardedModule:
    """Build the runtime over `root` and every marked module inside it (collective)."""
    members = [m for m in root.modules() if m is not root and _MARK in m.__dict__]
    built = [m for m in members if isinstance(m.__dict__.get(_RUNTIME), ShardedModule)]
    if id(root.__dict__[_MARK]) in {id(m.__dict__[_MARK]) for m in members}:
        raise ValueError(f"fully_shard: a list passed to fully_shard holds {type(root).__name__} and modules inside "
                         "it; a unit's modules must be apart")
    if built:
        raise RuntimeError(f"fully_shard: {type(built[0]).__name__} inside {type(root).__name__} was already used "
                           "(its forward, parameters or state dict) before fully_shard was called on its root; call "
                           "fully_shard on the blocks, then on the root, then use the model")
    root.__dict__[_IGNORED] = _ignored_places(root)
    request = _runtime_request(root, members)
    for module in [root, *members]:
        module.__dict__[_RUNTIME] = _BUILDING     # start-up reads the modules' parameters
    try:
        runtime = ShardedModule._for_request(root, request)
    except BaseException:
        for module in [root, *members]:
            del module.__dict__[_RUNTIME]
        raise
    for module in [root, *members]:
        module.__dict__[_RUNTIME] = runtime
        # Built: the hook has nothing left to do, and a hook costs every forward a call.
        module.__dict__.pop(_BUILD_HOOK).remove()
    register_grad_step([root, *members], runtime)
    calls = _calls_by_module(root)
    scheduler = runtime.scheduler
    for unit in scheduler.units:
        unit.reshard_after_forward = bool(calls[id(unit.modules[0])].reshard_after_forward)
        for module in unit.modules:
            if calls[id(module)].input_dtype() != scheduler.cast_dtype:
                scheduler.module_cast_dtypes[id(module)] = calls[id(module)].input_dtype()
    _gather_in_backward(runtime)
    return runtime


def _gather_in_backward(runtime: ShardedModule) -> None:
    """Each unit gathered for backward unless no module of it needs it: asked not to be
    (`set_unshard_in_backward(False)`), or, not asked, an embedding (`backward_reads_weights`);
    a bucket that also holds others is gathered, and says so."""
    calls = _calls_by_module(runtime.module)
    for unit in runtime.scheduler.units:
        asked = [calls[id(module)].unshard_in_backward for module in unit.modules]
        wanted = [backward_reads_weights([module]) if flag is None else flag
                  for module, flag in zip(unit.modules, asked)]
        # A pipeline stage's weight step reads the gathered leaves: such units are gathered.
        stage = any(group.stage_leaves for group in unit.groups)
        unit.gather_in_backward = any(wanted) or stage
        if unit.gather_in_backward and False in asked:
            why = "it is a pipeline stage's" if stage else \
                "the unit also holds modules that need their weights in backward"
            _hint(runtime, f"set_unshard_in_backward(False) on a module of unit {unit.name}: {why}, so it is "
                           "gathered for backward")


def _calls_by_module(root: nn.Module) -> dict[int, _Marked]:
    """Each module's `fully_shard` call: its own, else that of the nearest marked module that
    holds it (an expert module, split out of its block's unit under expert parallelism)."""
    calls: dict[int, _Marked] = {}

    def visit(module: nn.Module, call: _Marked) -> None:
        call = module.__dict__.get(_MARK, call)
        calls[id(module)] = call
        for child in module.children():
            visit(child, call)

    visit(root, root.__dict__[_MARK])
    return calls


def _build_before_forward(module: nn.Module, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """A model first used by a forward builds its runtime now; the runtime's own pre-hook on
    this module, registered meanwhile, misses this call (the module read its hooks before),
    so it runs here."""
    if _RUNTIME in module.__dict__:
        return None
    runtime = _runtime_of(module)
    if runtime is not None and runtime.module is module:
        return runtime._root_pre_forward(module, args, kwargs)
    return None


def _runtime_of(module: nn.Module) -> Optional[ShardedModule]:
    """The runtime that shards `module`, built now over its outermost marked module if none
    is yet (None while it is being built)."""
    runtime = module.__dict__.get(_RUNTIME)
    if runtime is _BUILDING:
        return None
    if runtime is not None:
        return runtime
    root = module
    while _OWNER in root.__dict__:
        root = root.__dict__[_OWNER]
    return _build(root)


def _required(module: nn.Module) -> ShardedModule:
    runtime = _runtime_of(module)
    if runtime is None:
        raise RuntimeError(f"{type(module).__name__}: called while fully_shard builds its model")
    return runtime


def _unit_of(module: nn.Module, runtime: ShardedModule) -> Any:
    if runtime.module is module:
        return runtime.scheduler.root
    return next((unit for unit in runtime.scheduler.units if any(m is module for m in unit.modules)), None)


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """`FSDP<cls>`: `cls` with FSDP2's module methods in front, made once per class."""
    if issubclass(cls, OverlapFSDPModule):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (OverlapFSDPModule, cls), {})
    return _CLASSES[cls]


class OverlapFSDPModule(FSDPModule):
    """FSDP2's module methods over the runtime (a `torch.distributed.fsdp.FSDPModule`)."""

    # [FSDP<Orig>, OverlapFSDPModule, FSDPModule, Orig, ...]: where FSDPModule.__new__ finds the original class.
    _orig_cls_mro_index = 3

    # ---- what a training loop reaches ----------------------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        _runtime_of(self)
        return super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The DTensor parameters, also while units are gathered (their gathered values are
        the registered parameters then, as FSDP2's unsharded ones)."""
        runtime = _runtime_of(self)
        if runtime is None:
            return super().state_dict(*args, **kwargs)
        with _sharded_registration(runtime):
            return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Each parameter's value (a DTensor of any sharding of its full shape, FSDP2's
        `distribute_tensor` result among them, or a full tensor) is written into this rank's
        rows of the flat shard; with `assign=True` too, so the parameters stay bound to their
        shards. A collective where values are sharded otherwise: every rank calls it."""
        runtime = _required(self)
        if runtime.module is not self:
            raise NotImplementedError(f"load_state_dict on {type(self).__name__}, a unit inside a model sharded with "
                                      "fully_shard: load the model's state dict at its root")
        mine = set(super().state_dict().keys())
        missing = sorted(mine - set(state_dict))
        unexpected = sorted(set(state_dict) - mine)
        if strict and (missing or unexpected):
            raise RuntimeError(strict_load_error("load_state_dict", missing, unexpected, type(self).__name__))
        runtime.load_state_dict({key: value for key, value in state_dict.items() if key in mine}, strict=False)
        return _IncompatibleKeys(missing, unexpected)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "OverlapFSDPModule":
        """`to_empty`, `.to(...)`, `.cuda()`: buffers move as asked; parameters stay bound to
        their shards, which already live where the runtime computes: a change of their dtype or
        device is refused by name."""
        runtime = _required(self)
        groups = [group for unit in runtime.scheduler.all_units for group in unit.groups]
        apply_keeping_shards(self, fn, groups, "fully_shard", runtime.module.__dict__[_IGNORED])
        return self

    def __getstate__(self) -> Any:
        """Refused, as FSDP2 refuses to deep-copy its modules (see `refused_copy`)."""
        raise TypeError(refused_copy("fully_shard", "torch's get_model_state_dict(full_state_dict=True)"))

    @property
    def overlap_runtime(self) -> ShardedModule:
        """The `ShardedModule` that runs the whole model (its scheduler's settings, say
        `scheduler.keep_units`)."""
        return _required(self)

    def overlap_report(self) -> Any:
        """The runtime's `OverlapReport` (communication hidden, its choices, the calls taken
        as hints), as `ShardedModule.overlap_report()`."""
        return _required(self).overlap_report()

    # ---- FSDPModule's calls ----------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> Optional["Unsharded"]:
        """Gather this module's unit now (collective); the next forward frees it and gathers as
        it plans (a hint: its own prefetch already gathers ahead)."""
        runtime = _required(self)
        _hint(runtime, f"unshard() of {type(self).__name__}")
        unit = _unit_of(self, runtime)
        if unit is not None:
            runtime.scheduler.unshard(unit)
        handle = Unsharded()
        return handle if async_op else None

    def reshard(self) -> None:
        runtime = _required(self)
        unit = _unit_of(self, runtime)
        if unit is not None:
            runtime.scheduler.reshard_now(unit)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False accumulates gradients locally until a backward with it True (the whole model)."""
        _required(self).set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        runtime = _required(self)
        if not requires_all_reduce and runtime.collectives.replicate_group is not None:
            raise NotImplementedError("set_requires_all_reduce(False) with replicas (a 2-D mesh): the all-reduce "
                                      "across replicas runs with each reduction; use set_requires_gradient_sync(False)")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"set_reshard_after_forward: expected a bool, got {reshard_after_forward!r}")
        runtime = _required(self)
        modules = [m for m in self.modules() if _MARK in m.__dict__] if recurse else [self]
        for unit in runtime.scheduler.units:
            if any(member in modules for member in unit.modules):
                unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps units gathered across the step's passes (the whole model: see
        `ShardedModule.set_reshard_after_backward`)."""
        _required(self).set_reshard_after_backward(reshard_after_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's unit, freed after forward, is not gathered again for backward,
        whose computation must not read its weights; its gradient is reduced as any other's.
        Set before the first forward, the unit is kept apart from the others' buckets. Not
        called, a unit of `nn.Embedding`s alone is not gathered for backward either (their
        backward reads indices only); True gathers it."""
        if not isinstance(unshard_in_backward, bool):
            raise TypeError(f"set_unshard_in_backward: expected a bool, got {unshard_in_backward!r}")
        self.__dict__[_MARK].unshard_in_backward = unshard_in_backward
        runtime = self.__dict__.get(_RUNTIME)
        if isinstance(runtime, ShardedModule):
            _gather_in_backward(runtime)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Every backward that syncs waits for its reductions at its end: nothing to change."""
        _required(self)

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        _hint(_required(self), f"set_modules_to_forward_prefetch({len(modules)} modules) on "
                                 f"{type(self).__name__}: prefetch follows the learned forward order")

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        _hint(_required(self), f"set_modules_to_backward_prefetch({len(modules)} modules) on "
                                 f"{type(self).__name__}: prefetch follows the learned backward order")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduced gradients are divided by `factor` instead of the ranks' count (the whole model)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: expected a number > 0, got {factor!r}")
        _required(self).collectives.gradient_divide_factor = float(factor)

    def set_post_optim_event(self, event: Any) -> None:
        """The next gathers wait for the compute stream anyway (one event per collective)."""
        _required(self)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's former name of `set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Already so: gradients are summed by the collectives, then scaled."""
        _required(self)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Already so: each unit's whole flat gradient is reduced, the rows of parameters that
        got no gradient as zeros, so ranks that used different parameters never mismatch."""
        _required(self)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        _hint(_required(self), f"set_reduce_scatter_max_input_buffers({max_input_buffers}): the runtime bounds "
                               "the reductions in flight itself")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        _hint(_required(self), f"set_separate_reduce_scatter_group({enable}): reductions overlap gathers on the "
                               "runtime's own streams")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        _hint(_required(self), f"set_allocate_memory_from_process_group_for_comm({enable}): the runtime allocates "
                               "its own communication buffers")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        _hint(_required(self), f"set_symm_mem_for_comm({backend!r}): gathers use the process group's own "
                               "buffers, not symmetric memory")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        _hint(_required(self), f"_set_unshard_async_op({async_op}): gathers are issued ahead, asynchronously")

    def set_custom_all_gather(self, comm: Any) -> None:
        _refuse_custom_collective("set_custom_all_gather", "the all-gathers")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        _refuse_custom_collective("set_custom_reduce_scatter", "the reduce-scatters")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        _refuse_custom_collective("set_all_reduce_hook", "the all-reduces across replicas")

    def reset_iter_state(self) -> None:
        _required(self).scheduler.reset_pass()

    def _get_fsdp_state(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__}: this FSDPModule method reaches FSDP2's internal state, "
                                  "which overlap's fully_shard does not have; the supported calls are listed in "
                                  "docs/fully_shard.md")

    def __setattr__(self, name: str, value: Any) -> None:
        """torch's own `register_fsdp_forward_method` sets a wrapper of the method that runs
        FSDP2's internal hooks: the method is registered with the runtime instead."""
        if isinstance(value, types.MethodType) and value.__self__ is self and \
                getattr(value.__func__.__code__, "co_qualname", None) == _TORCHS_FORWARD_METHOD:
            register_fsdp_forward_method(self, name)
            return
        super().__setattr__(name, value)


# The wrapper torch's `register_fsdp_forward_method` makes: its code's qualified name (the
# function's own is the method's, copied by functools.wraps).
_TORCHS_FORWARD_METHOD = "register_fsdp_forward_method.<locals>.wrapped_method"


@contextlib.contextmanager
def _sharded_registration(runtime: ShardedModule) -> Iterator[None]:
    """The DTensor parameters registered on their modules for the duration, whatever is gathered."""
    replaced = []
    for unit in runtime.scheduler.all_units:
        for group in unit.groups:
            for slot, param in zip(group.slots, group.module_params):
                for module, attr in slot.owners:
                    if module._parameters.get(attr) is not param:
                        replaced.append((module, attr, module._parameters[attr]))
                        module._parameters[attr] = param
    try:
        yield
    finally:
        for module, attr, value in replaced:
            module._parameters[attr] = value


def _refuse_custom_collective(call: str, what: str) -> None:
    raise NotImplementedError(f"fully_shard: {call} is not supported: the runtime issues {what} itself, on its own "
                              "streams and in its planned order; for smaller collectives use its compression "
                              "(OverlapPolicy(compression='int8'), docs/compression.md)")


def _hint(runtime: ShardedModule, text: str) -> None:
    hints = runtime.overlap_monitor.hints
    if text not in hints:
        hints.append(text)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>()` (a `generate`, say) run with the module's parameters
    gathered, as its forward does (FSDP2's function of this name)."""
    if not isinstance(module, OverlapFSDPModule):
        # A ShardedModule, the module it wraps or a unit's module; for any other module nothing,
        # as FSDP2's own does for a module it did not shard.
        register_forward_method(module, method_name)
        return
    runtime = _required(module)
    runtime.register_forward_method(module, method_name)


def mixed_precision_of(policy: MixedPrecisionPolicy) -> Optional[MixedPrecision]:
    """torch's policy as the runtime's (the same two dtypes)."""
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None
    return MixedPrecision(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)


__all__ = ["fully_shard", "register_fsdp_forward_method", "OverlapFSDPModule", "OverlapPolicy", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy", "FSDPModule"]
