"""`overlap train --pp N --checkpoint-dir`: each rank's stages and their AdamW state saved
under the whole model's names (a stage's modules keep them: overlap.train.pipeline), every
rank its own parts, so a run resumes at another pipeline layout (--pp, --pp-schedule) over
the same data-parallel ranks. The files are overlap.checkpoint's: published whole or not at
all, each item checksummed."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from overlap import checkpoint
from overlap.checkpoint.state import MODEL, OPTIM_STATE
from overlap.train.checkpoints import Load, Write

# AdamW's state of one parameter: its step count and the two moments, shaped like it.
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _items(modules: list[nn.Module], optimizer: torch.optim.Optimizer, fresh: bool) -> dict[str, Any]:
    """The stages' parameters and buffers, and each parameter's AdamW state (`fresh`: zeros
    for a load to fill, where no step has made any yet)."""
    items: dict[str, Any] = {}
    for module in modules:
        items.update({MODEL + name: value for name, value in module.state_dict().items()})
        for name, param in module.named_parameters():
            state = ({"step": torch.zeros((), dtype=torch.float32),
                      **{moment: torch.zeros_like(param) for moment in _MOMENTS}}
                     if fresh else optimizer.state.get(param, {}))
            items.update({f"{OPTIM_STATE}{name}.{key}": value for key, value in state.items()})
    return items


def stage_checkpoints(modules: list[nn.Module], optimizer: torch.optim.Optimizer) -> tuple[Load, Write]:
    """How this rank's stages and their optimizer are loaded and saved (called on every rank)."""

    def load(path: str) -> dict:
        items = _items(modules, optimizer, fresh=True)
        extra = checkpoint.load_items(path, items)
        for module in modules:
            module.load_state_dict({name: items[MODEL + name] for name in module.state_dict()})
            for name, param in module.named_parameters():
                optimizer.state[param] = {key: items[f"{OPTIM_STATE}{name}.{key}"] for key in ("step", *_MOMENTS)}
        return extra

    def write(path: str, extra: dict) -> checkpoint.PendingSave:
        return checkpoint.async_save_items(path, _items(modules, optimizer, fresh=False), extra)

    return load, write
