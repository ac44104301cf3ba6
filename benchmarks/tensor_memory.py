"""Peak tensor memory of one call, from torch.profiler's allocator records.

On CPU, resident memory (VmHWM) follows the C library's heap, which keeps freed blocks and
maps large ones on its own terms: it does not tell two runtimes' parameters apart. Every
tensor's storage comes from torch's allocator, which reports each allocation and free to the
profiler while it records with `profile_memory=True`; the running sum of those records, in
time order, is the tensor memory this process holds over what it held before the call.
"""
from __future__ import annotations

from typing import Callable


def peak_tensor_rise_mb(call: Callable[[], object]) -> float:
    """The highest tensor memory (MiB) held during `call()`, over what was held before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        call()
    records = sorted((event for event in recorded.profiler.kineto_results.events() if event.name() == "[memory]"),
                     key=lambda event: event.start_ns())
    held = peak = 0
    for event in records:
        held += event.nbytes()
        peak = max(peak, held)
    return peak / 2**20
