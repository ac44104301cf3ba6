"""Labels for every runtime phase: torch.profiler while it records, NVTX when enabled.

`record_function` labels make torch.profiler traces read per unit; NVTX ranges (OVERLAP_NVTX=1)
make the same phases show in Nsight Systems. A label is made only while the profiler records
(a range entered without one is dropped by torch anyway): the runtime opens several per unit
and step, and each costs microseconds of host time, which adds up over the units.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.profiler import record_function

_nvtx_enabled = False
_profiling = torch._C._autograd._profiler_enabled


def enable_nvtx(enabled: bool) -> None:
    global _nvtx_enabled
    _nvtx_enabled = bool(enabled) and torch.cuda.is_available()


_UNLABELLED = contextlib.nullcontext()


class _Labelled:
    """The range of one phase while the profiler records or NVTX is on."""

    __slots__ = ("name", "record")

    def __init__(self, name: str) -> None:
        self.name = name
        self.record = record_function(name) if _profiling() else None

    def __enter__(self) -> None:
        if self.record is not None:
            self.record.__enter__()
        if _nvtx_enabled:
            torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc: object) -> None:
        if _nvtx_enabled:
            torch.cuda.nvtx.range_pop()
        if self.record is not None:
            self.record.__exit__(None, None, None)


def labelling() -> bool:
    """Whether phases are labelled now (the profiler records, or NVTX is on)."""
    return _nvtx_enabled or _profiling()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """Mark one phase, e.g. ``overlap::all_gather::transformer.h.3``: a context manager,
    one shared no-op one when nothing records."""
    if _nvtx_enabled or _profiling():
        return _Labelled(name)
    return _UNLABELLED


class Span:
    """A labelled range opened in one hook and closed in another (a unit's forward runs from
    its pre-forward hook to its post-forward hook; its backward from the hook on its outputs'
    gradient to the hook on its parameters' gradient). NVTX start/end ranges, unlike
    push/pop, need not nest, which backward's interleaving requires."""

    def __init__(self, name: str) -> None:
        self._record = record_function(name) if _profiling() else None
        if self._record is not None:
            self._record.__enter__()
        self._nvtx = torch.cuda.nvtx.range_start(name) if _nvtx_enabled else None

    def close(self) -> None:
        if self._record is not None:
            self._record.__exit__(None, None, None)
        if self._nvtx is not None:
            torch.cuda.nvtx.range_end(self._nvtx)
