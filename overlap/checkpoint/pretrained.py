"""Loading pretrained weights from safetensors files straight into the shards: each rank
reads only the elements it keeps, one rectangular block at a time (safetensors slices a
tensor lazily, from the file's memory map), so loading needs no full copy of the model on
any rank, nor of any unit: the extra memory is one block of one parameter.

Accepted: a `.safetensors` file, or a Hugging Face checkpoint directory (`save_pretrained`)
holding `model.safetensors` or a sharded set with `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch


if TYPE_CHECKING:
    from overlap.sharded_module import ShardedModule

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _files_by_key(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it."""
    from safetensors import safe_open

    if os.path.isfile(path):
        files = [path]
    elif os.path.isfile(os.path.join(path, INDEX_FILE)):
        with open(os.path.join(path, INDEX_FILE)) as f:
            weight_map = json.load(f)["weight_map"]
        return {key: os.path.join(path, name) for key, name in weight_map.items()}
    elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
        files = [os.path.join(path, SINGLE_FILE)]
    else:
        raise FileNotFoundError(f"load_pretrained: {path} is neither a .safetensors file nor a directory with "
                                f"{SINGLE_FILE} or {INDEX_FILE}")
    by_key = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            by_key.update(dict.fromkeys(f.keys(), file))
    return by_key


def load_pretrained(model: "ShardedModule", path: str | os.PathLike) -> None:
    """Load the weights at `path` into `model` (every rank calls it; each reads its own parts).

    Every parameter and persistent buffer of the model must be in the files (a tied parameter
    under any one of its names, as `save_pretrained` writes it) with its shape, and the files
    must hold nothing else: otherwise a ValueError names the first key that differs, on every
    rank alike (each rank reads the same names and shapes)."""
    from safetensors import safe_open

    path = os.fspath(path)
    files = _files_by_key(path)
    layout: list[tuple[str, Any]] = model._state_dict_layout
    params: dict[tuple[Any, int], list[str]] = {}     # (group, slot index) -> the parameter's keys
    buffers: list[str] = []
    for key, where in layout:
        if where is None:
            buffers.append(key)
        else:
            params.setdefault(where, []).append(key)
    chosen: dict[tuple[Any, int], str] = {}
    for where, keys in params.items():
        present = [key for key in keys if key in files]
        if not present:
            raise ValueError(f"load_pretrained: {path} has no {keys[0]!r}")
        chosen[where] = present[0]
    for key in buffers:
        if key not in files:
            raise ValueError(f"load_pretrained: {path} has no {key!r}")
    known = {key for key, _ in layout}
    extra = sorted(key for key in files if key not in known)
    if extra:
        raise ValueError(f"load_pretrained: {path} holds {extra[0]!r}, which the model does not have "
                         f"({len(extra)} such keys)")

    handles: dict[str, Any] = {}
    try:
        def open_file(key: str):
            file = files[key]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            return handles[file]

        for (group, index), key in chosen.items():
            shape = tuple(group.slots[index].shape)
            stored = open_file(key).get_slice(key)
            if tuple(stored.get_shape()) != shape:
                raise ValueError(f"load_pretrained: {key!r} has shape {tuple(stored.get_shape())} in {path} "
                                 f"and {shape} in the model")
            _read_part(stored, shape, group, index)
        others = model._module_state_dict()
        with torch.no_grad():
            for key in buffers:
                value = open_file(key).get_tensor(key)
                if tuple(value.shape) != tuple(others[key].shape):
                    raise ValueError(f"load_pretrained: {key!r} has shape {tuple(value.shape)} in {path} "
                                     f"and {tuple(others[key].shape)} in the model")
                others[key].copy_(value)
    finally:
        handles.clear()


def _read_part(stored: Any, shape: tuple[int, ...], group: Any, index: int) -> None:
    """Copy this rank's rows of one parameter from the file (see [Note: row-aligned shards])."""
    start, end = group.parts[index]
    part = group.params[index]
    with torch.no_grad():
        dim = group.slots[index].dim
        if dim:                                         # sharded on another dimension: its block of slices
            if part.shape[0]:
                first = group.layout.first_row(index, group.collectives.rank, group.slots[index].laid_shape)
                block = stored[tuple(slice(first, first + part.shape[0]) if d == dim else slice(None)
                                     for d in range(len(shape)))]
                part.copy_(block.movedim(dim, 0))
            return
        if not shape:                                   # a 0-dim parameter
            if end > start:
                part.copy_(stored[...].reshape(-1))
            return
        if part.shape[0]:
            first = group.layout.first_row(index, group.collectives.rank, shape)
            part.copy_(stored[first:first + part.shape[0]])
