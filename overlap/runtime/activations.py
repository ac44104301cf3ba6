"""The tensors inside what units take and return, wherever they sit: nested lists, tuples,
dicts, named tuples, containers torch's pytree knows (a Hugging Face `ModelOutput`) and
dataclasses, which pytree leaves whole unless their class was registered with it. The
scheduler hooks the tensors that require a gradient: one it cannot see is an output whose
backward never re-gathers its unit, or an input whose gradient is never waited for before
the unit is freed (see [Note: when a unit is freed in backward])."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils import _pytree

Rebuild = Callable[[list], Any]


def flatten(value: Any) -> tuple[list[Any], Rebuild]:
    """The tensors in `value`, in order, and a function that rebuilds `value` around new ones."""
    leaves: list[Any] = []

    def walk(node: Any) -> Rebuild:
        if isinstance(node, torch.Tensor):
            leaves.append(node)
            index = len(leaves) - 1
            return lambda new: new[index]
        kind = _pytree._get_node_type(node)           # named tuples share one entry
        if kind in _pytree.SUPPORTED_NODES:
            children, context = _pytree.SUPPORTED_NODES[kind].flatten_fn(node)
            if not children:
                return lambda new: node
            builders = [walk(child) for child in children]
            unflatten = _pytree.SUPPORTED_NODES[kind].unflatten_fn
            return lambda new: unflatten([build(new) for build in builders], context)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            fields = [field.name for field in dataclasses.fields(node) if field.init]
            builders_by_name = {name: walk(getattr(node, name)) for name in fields}
            return lambda new: dataclasses.replace(node, **{name: build(new) for name, build
                                                           in builders_by_name.items()})
        return lambda new: node

    rebuild = walk(value)
    return leaves, rebuild
