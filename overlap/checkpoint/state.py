"""The flat key space of an overlap checkpoint, and the state dicts that fill it.

    model.<state-dict key>                    each parameter a DTensor of its full shape, buffers plain
    optimizer.state.<parameter>.<name>        state shaped like its parameter a DTensor like it, scalars plain
    optimizer.param_groups.<i>.<setting>      each group's settings, and `params`: its parameters' names
    extra/<name>                              the caller's values (the same on every rank)

These are the keys DCP writes for torchtitan's `{"model": get_model_state_dict(m),
"optimizer": get_optimizer_state_dict(m, opt)}` (DCP joins nested keys with dots), so a
checkpoint of FSDP2 loads here and one written here loads into FSDP2, at any world size.
Keys are made here rather than by DCP's flattening, so that loading needs no mapping table
from the caller's nested dicts: a saved key is (prefix, name, last component), and only the
last component (a state or setting name) never holds a dot.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from overlap.optim.adamw import PAGED_MOMENTS, paged_moments
from overlap.optim.paged import paged_of

if TYPE_CHECKING:
    from overlap.runtime.flat_group import FlatGroup
    from overlap.sharded_module import ShardedModule

MODEL = "model."
OPTIM_STATE = "optimizer.state."
PARAM_GROUPS = "optimizer.param_groups."
EXTRA = "extra/"


class CheckpointMismatch(ValueError):
    """The checkpoint was written for another model or another optimizer setup."""


def stored_shape(value: Any) -> Optional[tuple[int, ...]]:
    if isinstance(value, TensorStorageMetadata):
        return tuple(value.size)
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def _param_places(model: "ShardedModule") -> dict[int, tuple[str, "FlatGroup", int]]:
    """id(parameter) -> (its name, its flat group, its slot index)."""
    if any(group.dtensor_params for unit in model.scheduler.all_units for group in unit.groups):
        raise TypeError("overlap.checkpoint saves an optimizer's state for ShardedModule's parameters; a model "
                        "sharded with fully_shard saves it as FSDP2's does: dcp.save({'model': "
                        "get_model_state_dict(model), 'optimizer': get_optimizer_state_dict(model, optimizer)}, ...)")
    groups = {id(param): (group, index) for unit in model.scheduler.all_units for group in unit.groups
              for index, param in enumerate(group.params)}
    return {id(param): (name, *groups[id(param)]) for name, param in model.named_parameters()}


def model_items(model: "ShardedModule") -> dict[str, Any]:
    return {MODEL + key: value for key, value in model.state_dict().items()}


def streamed_keys(model: "ShardedModule", optimizer: Optional[torch.optim.Optimizer]) -> frozenset[str]:
    """The keys whose values map a state file (offload="disk"): the masters of paged
    parameters and, with `optimizer`, their moments. An asynchronous save writes them from
    the file instead of staging a copy."""
    keys = set()
    for name, param in model.named_parameters():
        if paged_of(param) is not None:
            keys.add(MODEL + name)
            if optimizer is not None:
                keys.update(f"{OPTIM_STATE}{name}.{moment}" for moment in PAGED_MOMENTS)
    return frozenset(keys)


def optimizer_items(model: "ShardedModule", optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    places = _param_places(model)
    items: dict[str, Any] = {}
    for number, param_group in enumerate(optimizer.param_groups):
        names = []
        for param in param_group["params"]:
            if id(param) not in places:
                raise ValueError("the optimizer holds a tensor that is not a parameter of the model; "
                                 "build it from model.parameters() or model.named_parameters()")
            name, group, index = places[id(param)]
            names.append(name)
            for state_name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == param.shape:
                    value = group.dtensor(value, index)      # element-wise: sharded like the parameter
                items[f"{OPTIM_STATE}{name}.{state_name}"] = value
        for setting, value in param_group.items():
            items[f"{PARAM_GROUPS}{number}.{setting}"] = names if setting == "params" else value
    return items


def check_model(path: str, metadata: Metadata, model: "ShardedModule") -> None:
    """Raise CheckpointMismatch naming the first key whose presence or shape differs."""
    saved = {key[len(MODEL):]: value for key, value in metadata.state_dict_metadata.items() if key.startswith(MODEL)}
    expected = model.state_dict()
    for key, value in expected.items():
        if key not in saved:
            raise CheckpointMismatch(f"checkpoint {path} has no {key!r} (shape {stored_shape(value)} in the model)")
        there, here = stored_shape(saved[key]), stored_shape(value)
        if there != here:
            raise CheckpointMismatch(f"checkpoint {path} does not fit the model: {key!r} has shape "
                                     f"{there} in the checkpoint and {here} in the model")
    unexpected = [key for key in saved if key not in expected]
    if unexpected:
        first = unexpected[0]
        raise CheckpointMismatch(f"checkpoint {path} holds {first!r} (shape {stored_shape(saved[first])}), "
                                 f"which the model does not have ({len(unexpected)} such keys)")


def optimizer_targets(path: str, metadata: Metadata, model: "ShardedModule") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Tensors for DCP to load the saved optimizer state into, made from the metadata: parts
    shaped like this rank's parameter parts for sharded state (returned also as the plain
    parts, by key), whole tensors for the rest."""
    places = _param_places(model)
    params = dict(model.named_parameters())
    targets: dict[str, Any] = {}
    parts: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(OPTIM_STATE):
            continue
        name = key[len(OPTIM_STATE):].rsplit(".", 1)[0]
        if name not in params:
            raise CheckpointMismatch(f"checkpoint {path} holds optimizer state for {name!r}, "
                                     "which the model does not have")
        param = params[name]
        _, group, index = places[id(param)]
        if isinstance(entry, BytesStorageMetadata):
            targets[key] = None
        elif list(entry.size) == (list(group.global_shape(index)) or [1]) and entry.size != torch.Size([]):
            parts[key] = _part_target(param, key.rsplit(".", 1)[1], entry.properties.dtype)
            targets[key] = group.dtensor(parts[key], index)
        else:
            targets[key] = torch.zeros(entry.size, dtype=entry.properties.dtype, device="cpu")
    for key in metadata.state_dict_metadata:
        if key.startswith(PARAM_GROUPS):
            targets[key] = None
    return targets, parts


def _part_target(param: torch.Tensor, state_name: str, dtype: torch.dtype) -> torch.Tensor:
    """Where DCP loads this rank's part of a parameter's element-wise state. A disk-offloaded
    parameter's moments are memory maps of the state file: DCP writes into the file in place,
    one stored chunk at a time, and the optimizer's state is these maps (as saving reads
    them), so no moment is ever held whole in memory nor cast to the parameter's 16-bit
    dtype. Anything else is a new tensor of the saved dtype."""
    if paged_of(param) is not None and state_name in PAGED_MOMENTS:
        return paged_moments(param)[state_name]
    return torch.zeros(param.shape, dtype=dtype, device=param.device)


def saved_groups(path: str, loaded: Mapping[str, Any], group_names: list[list[str]]) -> list[dict[str, Any]]:
    """The optimizer groups among loaded items, each a dict of its settings and `params` (its
    parameters' names), once checked against `group_names`, the names of the optimizer's
    groups: CheckpointMismatch names the first difference."""
    count = max((int(key[len(PARAM_GROUPS):].split(".", 1)[0]) + 1 for key in loaded if key.startswith(PARAM_GROUPS)),
                default=0)
    groups: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in loaded.items():
        if key.startswith(PARAM_GROUPS):
            number, setting = key[len(PARAM_GROUPS):].split(".", 1)
            groups[int(number)][setting] = value
    if len(groups) != len(group_names):
        raise CheckpointMismatch(f"checkpoint {path} has {len(groups)} optimizer parameter groups, "
                                 f"the optimizer has {len(group_names)}")
    for number, (saved, names) in enumerate(zip(groups, group_names)):
        listed = list(saved.get("params", []))
        if listed != names:
            differ = next((a, b) for a, b in zip(listed + [None], names + [None]) if a != b)
            raise CheckpointMismatch(f"checkpoint {path}: optimizer group {number} differs: {differ[0]!r} in the "
                                     f"checkpoint where the optimizer has {differ[1]!r}")
    return groups


def load_optimizer(path: str, loaded: Mapping[str, Any], parts: Mapping[str, torch.Tensor],
                   model: "ShardedModule", optimizer: torch.optim.Optimizer) -> None:
    """Hand the loaded items to `optimizer.load_state_dict` in its own index-keyed format."""
    names = {id(param): name for name, param in model.named_parameters()}
    group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    index_of: dict[str, int] = {}
    groups = [{**saved, "params": [index_of.setdefault(n, len(index_of)) for n in current]}
              for saved, current in zip(saved_groups(path, loaded, group_names), group_names)]
    state: dict[int, dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith(OPTIM_STATE):
            name, state_name = key[len(OPTIM_STATE):].rsplit(".", 1)
            value = parts.get(key, value)
            state.setdefault(index_of[name], {})[state_name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups})

