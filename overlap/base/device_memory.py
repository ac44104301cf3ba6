"""How much memory a rank can count on: the device's own (CUDA), or the host RAM available now
shared by the ranks on this node (CPU). What share of it the planner takes is
`overlap.plan.budget`'s rule."""
from __future__ import annotations

import os

import torch


def device_memory_bytes(device: torch.device, ranks_sharing_host: int = 1) -> int:
    """Total memory of a CUDA device; on CPU, the RAM available now over `ranks_sharing_host`."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks_sharing_host
