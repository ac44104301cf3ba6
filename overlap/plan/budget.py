"""The memory the planner plans within, as shares of a rank's memory
(`overlap.base.device_memory`, or a cluster preset's figure in `overlap simulate`).

The gathered-parameter budget caps the units gathered at once (prefetch depth and bucket
size); the memory limit caps what a sharding option may hold per rank, model states
included (`overlap.plan.sharding`), leaving the rest to activations and the allocator.
"""
from __future__ import annotations

# Without a budget set by the user: this share of a rank's memory for gathered parameters.
BUDGET_FRACTION = 0.10
# Share of a rank's memory the model states, gathered units and node copies may take.
MEMORY_SHARE = 0.5
# Without a window set by the user: this share of a rank's host memory for offload="disk"'s
# state read ahead during backward and written behind the step (overlap.optim.window).
DISK_WINDOW_FRACTION = 0.25


def gathered_budget(memory_bytes: float) -> int:
    """Default cap on gathered parameter bytes in flight on a rank with `memory_bytes`."""
    return int(BUDGET_FRACTION * memory_bytes)


def disk_window(host_bytes: float) -> int:
    """Default host bytes offload="disk" may hold its state in between backward and the write
    behind the step, on a rank with `host_bytes` of host memory."""
    return int(DISK_WINDOW_FRACTION * host_bytes)


def memory_limit(memory_bytes: float) -> int:
    """Cap on the bytes a sharding option may hold on a rank with `memory_bytes`."""
    return int(MEMORY_SHARE * memory_bytes)
