"""What a process group runs: which backend serves a device type, and the flat tensor
collectives under the name this torch gives them.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist

# Newer torch names the tensor-in/tensor-out collectives `*_single`; older releases only
# have the `*_tensor` spelling.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def device_backend(group: dist.ProcessGroup, device_type: str) -> Optional[str]:
    """The backend that runs `device_type` tensors in `group` ("gloo", "nccl"), None if none
    does. `dist.get_backend` cannot say: a group from `init_process_group()` without a
    backend is "undefined" there, one from "cpu:gloo,cuda:nccl" is that string."""
    pairs = dict(pair.split(":", 1) for pair in dist.get_backend_config(group).split(","))
    return pairs.get(device_type)
