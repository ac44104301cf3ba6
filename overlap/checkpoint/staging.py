"""The host copy an asynchronous save writes from.

DCP's file writer stages a state dict by making an empty copy of each tensor and filling it;
for a DTensor it does so on the local tensor, which for a tensor-parallel parameter's rows is
a `LocalShardsWrapper` (overlap.runtime.row_dtensors) that cannot make empty copies. The
writer here stages itself: each row DTensor becomes one over a CPU copy of its rows, plain
tensors CPU copies, other values deep copies, so training may change the originals while
the files are written. Values under `streamed` keys (offload="disk": memory maps of the
state file, kept unchanged by a pin until the files are written) are not copied.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from overlap.runtime.row_dtensors import copy_to_cpu


def stage_items(state_dict: dict[str, Any], streamed: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A copy of `state_dict` on the host that shares no memory with it, but for the values
    under `streamed` keys, kept as they are."""
    staged: dict[str, Any] = {}
    for key, value in state_dict.items():
        if key in streamed:
            staged[key] = value
        elif isinstance(value, DTensor):
            staged[key] = copy_to_cpu(value)
        elif isinstance(value, torch.Tensor):
            staged[key] = value.detach().to("cpu", copy=True)
        else:
            staged[key] = copy.deepcopy(value)
    return staged


class StagingWriter(FileSystemWriter):
    """DCP's file writer, staging asynchronous saves with `stage_items`."""

    def __init__(self, path: str, *, streamed: frozenset[str] = frozenset()) -> None:
        super().__init__(path)
        self.streamed = streamed

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.per_thread_copy_ahead = 0          # as DCP's own stage: the copy is on the host already
        return stage_items(state_dict, self.streamed)
