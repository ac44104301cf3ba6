"""Giving values to a model built on the meta device, one module at a time, keeping only
this rank's part of each parameter.

Modules are visited in the model's module order. For each, its meta parameters (and meta
buffers) are created in full in host memory, filled with NaN, initialised by
`param_init_fn(module)` (or the module's own `reset_parameters()`), and each parameter's part
is copied into its flat shard on the device; the full tensor is dropped once the last module
that holds it (a tied parameter has several; the first initialises it) is done. Peak memory
is therefore the shards plus one module's parameters in full (plus a tied parameter until
its last holder), the latter in host memory.

Every rank computes every full value from rank 0's generator state: rank 0's CPU generator
state (and its CUDA one, on CUDA) is broadcast and set for the materialisation, and each
rank's own state is restored afterwards. So the user need not seed the ranks alike, the
result does not depend on the world size, and materialising leaves each rank's generators
as they were (an eager build advances them).

Values are created and initialised on the CPU, whatever the device, and each rank's part is
copied to the device: the CUDA generator draws other numbers than the CPU one, and a module
initialised in construction order must get the values eager CPU construction gives it.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter, defaultdict
from typing import Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from overlap.runtime.flat_group import FlatGroup

# (module, attribute, parameter) for every place a meta parameter is registered
MetaPlace = tuple[nn.Module, str, nn.Parameter]
InitFn = Callable[[nn.Module], None]

# Where full values are created and initialised (see the module note).
_HOST = torch.device("cpu")


def meta_places(root: nn.Module) -> list[MetaPlace]:
    return [(module, attr, param) for module in root.modules() for attr, param in module._parameters.items()
            if param is not None and param.is_meta]


def _unset(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A full tensor whose elements read as not initialised: NaN, or 0 for integer dtypes."""
    value = math.nan if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full(shape, value, dtype=dtype, device=device)


def _initialise(name: str, module: nn.Module, init_fn: Optional[InitFn], created: list[str]) -> None:
    """`init_fn(module)`; the module's own `reset_parameters()` where that left something unset."""
    if init_fn is not None:
        init_fn(module)
        if not _uninitialised(module, created):
            return
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif init_fn is None:
        raise ValueError(f"ShardedModule: module {name or '<root>'} ({type(module).__name__}) has parameters or "
                         "buffers on the meta device and no reset_parameters(); pass param_init_fn to initialise it")


def _uninitialised(module: nn.Module, created: list[str]) -> list[str]:
    """Those of the tensors created from meta (`created`, by attribute) that still hold NaN."""
    tensors = {**module._parameters, **module._buffers}
    return [attr for attr in created if tensors[attr].is_floating_point() and bool(torch.isnan(tensors[attr]).any())]


@contextlib.contextmanager
def _rank0_generators(device: torch.device, group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Inside, every rank's CPU generator (and `device`'s, on CUDA) holds rank 0's state;
    each rank's own state is restored on exit."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        states = [torch.get_rng_state(), torch.cuda.get_rng_state(cuda[0]) if cuda else None]
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(states, src=dist.get_global_rank(group, 0), group=group)
        torch.set_rng_state(states[0])
        if cuda:
            torch.cuda.set_rng_state(states[1], cuda[0])
        yield


def _ranks_group(slot_of: Mapping[int, tuple[FlatGroup, int]]) -> Optional[dist.ProcessGroup]:
    """Every rank holding a part of the model: the group its flat groups were built for
    (the one `check_same_values` compares over), or None for a model without parameters."""
    return next((group.collectives.all_group for group, _ in slot_of.values()), None)


def materialize(root: nn.Module, places: list[MetaPlace], slot_of: Mapping[int, tuple[FlatGroup, int]],
                device: torch.device, init_fn: Optional[InitFn]) -> dict[str, float]:
    """Initialise every meta parameter and buffer of `root` (see the module note); returns a
    checksum of each parameter's full value, by name, for the ranks to compare."""
    with _rank0_generators(device, _ranks_group(slot_of)):
        return _materialize(root, places, slot_of, device, init_fn)


def _materialize(root: nn.Module, places: list[MetaPlace], slot_of: Mapping[int, tuple[FlatGroup, int]],
                 device: torch.device, init_fn: Optional[InitFn]) -> dict[str, float]:
    by_module: dict[int, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    for module, attr, param in places:
        by_module[id(module)].append((attr, param))
    holders_left = Counter(id(param) for _, _, param in places)
    full: dict[int, nn.Parameter] = {}
    checksums: dict[str, float] = {}
    for name, module in root.named_modules():
        metas = by_module.get(id(module), [])
        meta_buffers = [key for key, b in module._buffers.items() if b is not None and b.is_meta]
        if not metas and not meta_buffers:
            continue
        for attr, param in metas:
            # The parameter already holds this rank's part (overlap.runtime.param_identity):
            # its full shape is its slot's.
            group, index = slot_of[id(param)]
            shape = group.slots[index].shape
            if id(param) in full:
                # A tied parameter keeps the values its first holder gave it: this holder
                # initialises a scratch copy, as it initialised its own tensor before the tie
                # in eager construction.
                module._parameters[attr] = nn.Parameter(_unset(shape, group.master_dtype, _HOST))
            else:
                full[id(param)] = nn.Parameter(_unset(shape, group.master_dtype, _HOST),
                                               requires_grad=param.requires_grad)
                module._parameters[attr] = full[id(param)]
        for key in meta_buffers:
            module._buffers[key] = _unset(module._buffers[key].shape, module._buffers[key].dtype, _HOST)
        created = [attr for attr, _ in metas] + meta_buffers
        with torch.no_grad():
            _initialise(name, module, init_fn, created)
        left = _uninitialised(module, created)
        if left:
            prefix = f"{name}." if name else ""
            raise ValueError(f"ShardedModule: {prefix}{left[0]} is still uninitialised after "
                             f"{'param_init_fn' if init_fn else 'reset_parameters()'} ran on {name or '<root>'} "
                             f"({type(module).__name__})")
        for key in meta_buffers:
            module._buffers[key] = module._buffers[key].to(device)
        for attr, param in metas:
            value = full[id(param)]
            group, index = slot_of[id(param)]
            if module._parameters[attr] is value:
                group.write_part(index, value)
            module._parameters[attr] = group.module_params[index]
            holders_left[id(param)] -= 1
            if holders_left[id(param)] == 0:
                checksums[group.slots[index].name] = float(value.detach().double().sum())
                del full[id(param)]
    return checksums


def check_same_values(checksums: dict[str, float], group: dist.ProcessGroup) -> None:
    """Every rank computed every full value itself, from rank 0's generator state: they must
    agree, or the shards would belong to different models. Raises the same error on every rank."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    gathered: list = [None] * world
    dist.all_gather_object(gathered, checksums, group=group)
    for name in checksums:
        values = [ranks[name] for ranks in gathered]
        if any(v != values[0] and not (math.isnan(v) and math.isnan(values[0])) for v in values):
            raise ValueError(f"ShardedModule: ranks initialised {name} differently (sums {values}); every rank "
                             "draws from rank 0's torch generator state, so the initialisation depends on something "
                             "else that differs between ranks (its own generator, the rank, the time)")
