"""Peak memory of one rank of `overlap train`, as its progress bar shows it."""
from __future__ import annotations

import resource

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Allocated device memory on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB
