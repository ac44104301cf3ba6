"""Flat-buffer kernels used by the sharding runtime, behind one small interface.

Three operations cover every copy the runtime makes between parameters, shards and
collective buffers:

- ``pack(srcs, dst, offsets, scale)``: many tensors into one flat buffer at element offsets,
  multiplied by ``scale`` and cast to ``dst.dtype`` (flatten at construction, the cast of a
  master shard to the all-gather dtype, pre-division of gradients by the world size).
- ``unpack(src, dsts, offsets)``: a flat buffer back into many tensors (full state dicts).
- ``accumulate(dst, src, scale, num_chunks)``: ``dst += scale * sum of num_chunks equal
  chunks of src`` (reduce-scatter output, or the chunks an all-to-all returns, into the fp32
  sharded gradient).

Backends: ``torch`` (reference), and the optional compiled ones registered below. The
choice is made by name through :func:`get_backend`; ``auto`` picks the fastest backend
available for a device.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .reference import TorchKernels

BACKEND_NAMES = ("auto", "torch", "triton", "ext", "cupy")


class KernelBackend(Protocol):
    name: str

    def supports(self, device: torch.device) -> bool: ...

    def pack(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int],
             scale: float = 1.0) -> None: ...

    def unpack(self, src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None: ...

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0,
                   num_chunks: int = 1) -> None: ...


class BackendUnavailable(RuntimeError):
    """Raised when a backend is asked for by name but cannot run here."""


def _load(name: str) -> KernelBackend:
    if name == "torch":
        return TorchKernels()
    raise BackendUnavailable(f"kernel backend {name!r} is not available in this install")


def available_backends(device: torch.device) -> list[str]:
    """Names of the backends that can run on `device`, fastest first."""
    names = []
    for name in ("torch",):
        try:
            if _load(name).supports(device):
                names.append(name)
        except BackendUnavailable:
            pass
    return names


def get_backend(name: str, device: torch.device) -> KernelBackend:
    """The backend called `name` for tensors on `device`; `auto` picks the fastest available."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        return _load(available_backends(device)[0])
    backend = _load(name)
    if not backend.supports(device):
        raise BackendUnavailable(f"kernel backend {name!r} cannot run on device {device}")
    return backend
