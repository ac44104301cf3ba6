"""The flat-buffer kernels' interface, its backends by name, and the choice among them.

The kernels the sharding runtime uses sit behind one small interface.

Two operations cover every copy the runtime makes between parameters, shards and
collective buffers:

- ``pack(srcs, dst, offsets, scale)``: many tensors into one flat buffer at element offsets,
  multiplied by ``scale`` and cast to ``dst.dtype`` (flatten at construction, the cast of a
  master shard to the all-gather dtype, pre-division of gradients by the world size).
- ``accumulate(dst, src, scale, num_chunks)``: ``dst += scale * sum of num_chunks equal
  chunks of src`` (reduce-scatter output, or the chunks an all-to-all returns, into the fp32
  sharded gradient).

Four more carry block-quantised communication (layout, rounding and the inf/NaN rule:
:mod:`overlap.kernels.quantized`):

- ``quantize_int8(src, out_q, out_scales, block, error=None)`` and ``quantize_int4(...)``:
  per-block absmax scales and int8 (or packed int4) values, with error feedback fused in
  when ``error`` is given (the send side of a quantised reduce-scatter or all-gather).
- ``dequantize_accumulate(dst, q, scales, block, bits, chunks=1)``: ``dst += sum of chunks
  dequantised chunks`` in fp32 (the receive side of a quantised reduce-scatter).
- ``dequantize_into(dst, q, scales, block, bits)``: dequantised values cast into ``dst``
  (a gathered parameter buffer of any float dtype).

Backends: ``torch`` (reference), ``ext`` (the ``overlap._C`` C++/CUDA extension),
``triton`` and ``cupy`` (NVRTC); the compiled ones share ``kernels/flat_kernels.cu`` or its
semantics and are tested element for element against the reference. The choice is made by
name through :func:`get_backend`; ``auto`` picks the fastest backend available for a device.

kernels/ has no ``__init__.py`` on purpose. It is reached as ``overlap.kernels`` (installed, and
in the checkout through the link ``overlap/kernels``); from the checkout's root, on the import
path whenever Python runs there, it is only a namespace portion named ``kernels``, and a regular
package of that name (PyPI's ``kernels``, which transformers imports) takes precedence over it.
So it shadows nothing.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from .reference import TorchKernels

BACKEND_NAMES = ("auto", "torch", "triton", "ext", "cupy")


class KernelBackend(Protocol):
    name: str

    def supports(self, device: torch.device) -> bool: ...

    def pack(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int],
             scale: float = 1.0) -> None: ...

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0,
                   num_chunks: int = 1) -> None: ...

    def quantize_int8(self, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor, block: int,
                      error: Optional[torch.Tensor] = None) -> None: ...

    def quantize_int4(self, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor, block: int,
                      error: Optional[torch.Tensor] = None) -> None: ...

    def dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                              bits: int, chunks: int = 1) -> None: ...

    def dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                        bits: int) -> None: ...


class BackendUnavailable(RuntimeError):
    """Raised when a backend is asked for by name but cannot run here."""


# Fastest first, per device type. CPU (measured, benchmarks/kernels.py): the extension
# beats torch on the runtime's per-step calls (one pass instead of a temporary and a copy)
# and matches torch.cat on many small tensors; Triton on CPU is its interpreter, for tests
# only. CUDA: Triton first, as it needs no compiled extension matching the installed torch;
# then the extension, then CuPy. Their relative speed on a GPU is not yet measured
# (benchmarks/gpu_check.sh prints the comparison that should settle this order).
AUTO_ORDER = {
    "cpu": ("ext", "torch", "triton"),
    "cuda": ("triton", "ext", "cupy", "torch"),
}
_loaded: dict[str, KernelBackend] = {}


def _load(name: str) -> KernelBackend:
    """The backend object for `name`, created once; BackendUnavailable if it cannot be imported."""
    if name in _loaded:
        return _loaded[name]
    try:
        if name == "torch":
            backend: KernelBackend = TorchKernels()
        elif name == "triton":
            from .triton_backend import TritonKernels
            backend = TritonKernels()
        elif name == "ext":
            from .ext_backend import ExtKernels
            backend = ExtKernels()
        elif name == "cupy":
            from .cupy_backend import CupyKernels
            backend = CupyKernels()
        else:
            raise BackendUnavailable(f"kernel backend {name!r} is not available in this install")
    except ImportError as exc:
        hint = {"ext": "overlap._C was not built (reinstall with a C++ compiler)",
                "triton": "install triton", "cupy": "install cupy-cuda13x"}.get(name, "")
        raise BackendUnavailable(f"kernel backend {name!r} is not available: {exc}; {hint}") from exc
    _loaded[name] = backend
    return backend


def _usable(name: str, device: torch.device) -> bool:
    try:
        return _load(name).supports(device)
    except BackendUnavailable:
        return False


def available_backends(device: torch.device) -> list[str]:
    """Names of the backends that can run on `device`, fastest first."""
    device = torch.device(device)
    return [name for name in AUTO_ORDER.get(device.type, ("torch",)) if _usable(name, device)]


def load_extension() -> bool:
    """Import `overlap._C`, which registers every `torch.ops.overlap` op (these kernels' and the
    CPU AdamW step of `overlap.optim`); False where the extension was not built."""
    try:
        from .ext_backend import _load_ops
        _load_ops()
    except ImportError:
        return False
    return True


def get_backend(name: str, device: torch.device) -> KernelBackend:
    """The backend called `name` for tensors on `device`; `auto` picks the fastest available."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "auto":
        # The first usable backend in AUTO_ORDER; the later ones are not even imported.
        return _load(next(n for n in AUTO_ORDER.get(device.type, ("torch",)) if _usable(n, device)))
    backend = _load(name)
    if not backend.supports(device):
        hint = " (Triton runs CPU tensors only in its interpreter, TRITON_INTERPRET=1)" \
            if name == "triton" and device.type == "cpu" else ""
        raise BackendUnavailable(f"kernel backend {name!r} cannot run on device {device}{hint}")
    return backend
