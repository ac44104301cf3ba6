"""What the compiled backends (Triton, C++ extension, CuPy) share around their kernels.

`CompiledKernels` checks every call's arguments (a compiled kernel given a bad offset writes
out of bounds instead of raising), hands the tensors whose dtype the kernels cover to the
backend's `_pack`/`_accumulate`, `_quantize_kernel` and `_dequantize_into_kernel`,
and leaves the rest (float64, integers) to the torch reference, whose semantics the kernels
reproduce. Backends implement `_dequantize_accumulate` directly: its destination is always
float32. Helpers below build the per-dtype groups and the device tables (address, numel,
offset) that multi-tensor launches read.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch

from .quantized import QuantizedOps
from .reference import TorchKernels

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_reference = TorchKernels()


def _check_flat(flat: torch.Tensor, op: str, what: str) -> None:
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(f"{op}: {what} must be a contiguous 1-D tensor, got shape {tuple(flat.shape)} "
                         f"with strides {flat.stride()}")


def _check_regions(tensors: Sequence[torch.Tensor], offsets: Sequence[int], flat: torch.Tensor, op: str) -> None:
    if len(tensors) != len(offsets):
        raise ValueError(f"{op}: {len(tensors)} tensors but {len(offsets)} offsets")
    for i, (tensor, offset) in enumerate(zip(tensors, offsets)):
        if tensor.device != flat.device:
            raise ValueError(f"{op}: tensor {i} is on {tensor.device} but the flat buffer is on {flat.device}")
        if offset < 0 or offset + tensor.numel() > flat.numel():
            raise ValueError(f"{op}: tensor {i} ({tensor.numel()} elements at offset {offset}) does not fit "
                             f"in a flat buffer of {flat.numel()} elements")


def group_by_dtype(tensors: Sequence[torch.Tensor], offsets: Sequence[int]
                   ) -> dict[torch.dtype, tuple[list[torch.Tensor], list[int]]]:
    """Tensors (made contiguous) and their offsets, per dtype, so each group is one launch."""
    groups: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = defaultdict(lambda: ([], []))
    for tensor, offset in zip(tensors, offsets):
        group = groups[tensor.dtype]
        group[0].append(tensor.contiguous())
        group[1].append(int(offset))
    return dict(groups)


def device_table(tensors: Sequence[torch.Tensor], offsets: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 rows [address..., numel..., offset...] on `device`.

    On CUDA the host side is pinned so the copy does not block the host; torch's pinned
    allocator keeps the block until the copy has run.
    """
    rows = [t.data_ptr() for t in tensors] + [t.numel() for t in tensors] + [int(o) for o in offsets]
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class CompiledKernels(QuantizedOps):
    """Argument checks and dtype routing around a backend's kernels; see the module docstring.

    Subclasses implement `supports` and the underscored methods, which only ever see
    tensors of KERNEL_DTYPES on one device, flat buffers that are contiguous and 1-D, and
    regions that fit.
    """

    name = "compiled"

    def supports(self, device: torch.device) -> bool:
        raise NotImplementedError

    def pack(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int],
             scale: float = 1.0) -> None:
        _check_flat(dst, "pack", "dst")
        _check_regions(srcs, offsets, dst, "pack")
        if dst.dtype not in KERNEL_DTYPES:
            _reference.pack(srcs, dst, offsets, scale)
            return
        ours = [(s, o) for s, o in zip(srcs, offsets) if s.dtype in KERNEL_DTYPES]
        others = [(s, o) for s, o in zip(srcs, offsets) if s.dtype not in KERNEL_DTYPES]
        if others:
            _reference.pack([s for s, _ in others], dst, [o for _, o in others], scale)
        if ours:
            self._pack([s for s, _ in ours], dst, [o for _, o in ours], float(scale))

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, num_chunks: int = 1) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"accumulate: num_chunks={num_chunks!r} is invalid; expected an integer >= 1")
        if src.numel() != num_chunks * dst.numel():
            raise ValueError(f"accumulate: src has {src.numel()} elements, expected num_chunks ({num_chunks}) "
                             f"x dst's {dst.numel()}")
        if src.device != dst.device:
            raise ValueError(f"accumulate: src is on {src.device} but dst is on {dst.device}")
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.dtype not in KERNEL_DTYPES \
                or src.dtype not in KERNEL_DTYPES:
            _reference.accumulate(dst, src, scale, num_chunks)
            return
        if dst.numel() > 0:
            self._accumulate(dst, src, float(scale), num_chunks)

    # Quantised ops: QuantizedOps has checked the arguments; float64 goes to the reference.

    def _quantize(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, error: Optional[torch.Tensor],
                  block: int, bits: int) -> None:
        if src.dtype in KERNEL_DTYPES:
            self._quantize_kernel(src, q, scales, error, block, bits)
        else:
            _reference._quantize(src, q, scales, error, block, bits)

    def _dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                         bits: int) -> None:
        if dst.dtype in KERNEL_DTYPES:
            self._dequantize_into_kernel(dst, q, scales, block, bits)
        else:
            _reference._dequantize_into(dst, q, scales, block, bits)

    # ---- implemented by each backend -------------------------------------------------------

    def _pack(self, srcs: list[torch.Tensor], dst: torch.Tensor, offsets: list[int], scale: float) -> None:
        raise NotImplementedError

    def _accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float, num_chunks: int) -> None:
        raise NotImplementedError

    def _quantize_kernel(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                         error: Optional[torch.Tensor], block: int, bits: int) -> None:
        raise NotImplementedError

    def _dequantize_into_kernel(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                                bits: int) -> None:
        raise NotImplementedError
