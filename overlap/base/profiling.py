"""Labels for every runtime phase: torch.profiler always, NVTX when enabled.

`record_function` labels make torch.profiler traces read per unit; NVTX ranges (OVERLAP_NVTX=1)
make the same phases show in Nsight Systems.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.autograd.profiler import record_function

_nvtx_enabled = False


def enable_nvtx(enabled: bool) -> None:
    global _nvtx_enabled
    _nvtx_enabled = bool(enabled) and torch.cuda.is_available()


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark one phase, e.g. ``overlap::all_gather::transformer.h.3``."""
    with record_function(name):
        if _nvtx_enabled:
            torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                torch.cuda.nvtx.range_pop()
        else:
            yield


class Span:
    """A labelled range opened in one hook and closed in another (a unit's forward runs from
    its pre-forward hook to its post-forward hook; its backward from the hook on its outputs'
    gradient to the hook on its parameters' gradient). NVTX start/end ranges, unlike
    push/pop, need not nest, which backward's interleaving requires."""

    def __init__(self, name: str) -> None:
        self._record = record_function(name)
        self._record.__enter__()
        self._nvtx = torch.cuda.nvtx.range_start(name) if _nvtx_enabled else None

    def close(self) -> None:
        self._record.__exit__(None, None, None)
        if self._nvtx is not None:
            torch.cuda.nvtx.range_end(self._nvtx)
