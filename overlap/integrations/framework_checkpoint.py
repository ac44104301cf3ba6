"""A framework's checkpoint as an overlap checkpoint: the model and optimizer sharded through
`overlap.checkpoint` (each rank writes its parts; loads at any world size), and the
framework's own state (loop counters, callbacks, schedulers) as one extra item in the same
directory, so that it appears and disappears with the rest (a save that dies midway leaves
nothing that looks loadable)."""
from __future__ import annotations

import os
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from overlap import checkpoint
from overlap.sharded_module import ShardedModule


def save_checkpoint(path: str | os.PathLike, model: ShardedModule, optimizer: Optional[torch.optim.Optimizer],
                    state: Mapping[str, Any], key: str) -> None:
    """Every rank: write `model`, `optimizer` and the framework's `state` (plain values and
    tensors, as `torch.load(weights_only=True)` reads them) to the directory `path`."""
    path = os.fspath(path)
    group = model.collectives.all_group
    # A framework's default checkpoint is one file; a directory replaces one of the same name.
    if dist.get_rank(group) == 0 and os.path.isfile(path):
        os.remove(path)
    checkpoint.save(path, model, optimizer, extra={key: dict(state)})


def load_checkpoint(path: str | os.PathLike, model: ShardedModule, optimizer: Optional[torch.optim.Optimizer],
                    key: str) -> dict[str, Any]:
    """Every rank: load `model` and `optimizer` in place from a checkpoint `save_checkpoint`
    wrote (at any world size); returns the framework's state saved with it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"overlap: {path} is not a sharded checkpoint directory (written by save_checkpoint)")
    extra = checkpoint.load(path, model, optimizer)
    if key not in extra:
        raise checkpoint.CheckpointMismatch(f"checkpoint {path} holds no {key!r} state: it was not written "
                                            "by this integration")
    return dict(extra[key])
