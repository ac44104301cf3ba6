"""`Module._apply` (`to_empty`, `.to(...)`, `.cuda()`, `.double()`) over a sharded model.

torch's own `_apply` replaces each parameter by `fn(parameter)`: a new tensor, no longer a view
of the flat shard, which the optimizer would then step while the gathers keep sending the old
shard (a silent detach). Here the shards already live where the runtime computes, so a call
that leaves a parameter's dtype and device as they are (`to_empty(device=...)` of FSDP2's
meta-device idiom, `.to(device)` to that device) keeps every parameter as it is, and one that
would change them is refused by name. Buffers are not sharded: they go through `fn` as usual,
as do parameters left out of sharding (`fully_shard`'s `ignored_params`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from overlap.runtime.flat_group import FlatGroup


def apply_keeping_shards(root: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], groups: list[FlatGroup],
                         what: str, ignored: Sequence[tuple[nn.Module, str]] = ()) -> None:
    """`root._apply(fn)` with the parameters of `groups` kept bound to their shards (see the
    note), and those registered at the places `ignored` ((module, attribute) pairs) converted
    as torch converts a module's; `what` names the wrapper in errors. Raises before changing
    anything."""
    for group in groups:
        shard = group.params[0] if group.params else group.shard
        probe = fn(torch.empty(0, dtype=shard.dtype, device=shard.device))
        if probe.dtype != shard.dtype:
            raise TypeError(f"{what}: changing the parameters' dtype ({shard.dtype} to {probe.dtype}) after "
                            "wrapping would detach them from their shards; convert the model before wrapping, or "
                            "compute in another dtype with mixed precision")
        if probe.device not in (shard.device, group.collectives.device):
            raise ValueError(f"{what}: moving the parameters to {probe.device} after wrapping would detach them from "
                             f"their shards on {group.collectives.device}; build the model on that device (or on "
                             "the meta device) before wrapping")
    bound = {id(param) for group in groups for param in group.module_params}
    left_out = {id(module._parameters[name]) for module, name in ignored}
    for module in root.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in bound | left_out:
                raise RuntimeError(f"{what}: parameter {name!r} of {type(module).__name__} is not one of the "
                                   "sharded parameters; it was set after wrapping")
    for module in root.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) in left_out:
                _convert_param(module, name, param, fn)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = fn(buffer)


def _convert_param(module: nn.Module, name: str, param: nn.Parameter,
                   fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """`fn` on one parameter as `nn.Module._apply` does it: in place where the new tensor can
    take the parameter's place (the same object stays), else a new Parameter registered."""
    with torch.no_grad():
        converted = fn(param)
    if torch._has_compatible_shallow_copy_type(param, converted):
        param.data = converted
    else:
        module._parameters[name] = nn.Parameter(converted, param.requires_grad)
