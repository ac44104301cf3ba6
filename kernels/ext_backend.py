"""The `ext` backend: the `overlap._C` extension's `torch.ops.overlap` custom ops.

Built by setup.py from csrc/: a CPU implementation always (split over tensors and blocks,
vectorised for the CPU it runs on), and a CUDA one when the build had CUDA and nvcc. The
CUDA kernels are kernels/flat_kernels.cu, the same source the `cupy` backend compiles.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .compiled import CompiledKernels


def _load_ops() -> None:
    """Import the extension, which registers torch.ops.overlap.*; ImportError if it was not built."""
    import overlap._C  # noqa: F401


def param_views_op():
    """The extension's `param_views` op (csrc/param_views.cpp), or None where it was not built."""
    try:
        _load_ops()
        return torch.ops.overlap.param_views.default
    except (ImportError, AttributeError, RuntimeError):
        return None


# What the ops raise for a call they refuse (see csrc/flat_ops.h).
_REFUSED = (ValueError, TypeError)


def _ints(*values) -> bool:
    return all(type(v) is int for v in values)


def _has_kernel(device_type: str) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key("overlap::pack", key)


class ExtKernels(CompiledKernels):
    name = "ext"

    def __init__(self) -> None:
        _load_ops()
        self._ops = torch.ops.overlap

    def supports(self, device: torch.device) -> bool:
        return _has_kernel(torch.device(device).type)

    # The ops check every argument before writing anything, in C++, which costs far less than
    # CompiledKernels' checks in Python for hundreds of tensors. A call they refuse (bad
    # arguments: ValueError; a dtype the kernels do not cover: TypeError) takes the checked
    # path instead, which raises a ValueError naming the problem or hands uncovered dtypes to
    # the reference. Anything else (a CUDA fault, no kernel image for this GPU) is raised as it
    # is: launching again would only hide it.

    def pack(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int],
             scale: float = 1.0) -> None:
        try:
            self._ops.pack(srcs, dst, offsets, float(scale))
        except _REFUSED:
            super().pack(srcs, dst, offsets, scale)

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, num_chunks: int = 1) -> None:
        try:
            self._ops.accumulate(dst, src, float(scale), num_chunks)
        except _REFUSED:
            super().accumulate(dst, src, scale, num_chunks)

    def quantize_int8(self, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor, block: int,
                      error: Optional[torch.Tensor] = None) -> None:
        if not self._run("quantize", (src, out_q, out_scales, error, block, 8), (block,)):
            super().quantize_int8(src, out_q, out_scales, block, error)

    def quantize_int4(self, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor, block: int,
                      error: Optional[torch.Tensor] = None) -> None:
        if not self._run("quantize", (src, out_q, out_scales, error, block, 4), (block,)):
            super().quantize_int4(src, out_q, out_scales, block, error)

    def dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                              bits: int, chunks: int = 1) -> None:
        if not self._run("dequantize_accumulate", (dst, q, scales, block, bits, chunks), (block, bits, chunks)):
            super().dequantize_accumulate(dst, q, scales, block, bits, chunks)

    def dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                        bits: int) -> None:
        if not self._run("dequantize_into", (dst, q, scales, block, bits), (block, bits)):
            super().dequantize_into(dst, q, scales, block, bits)

    def _run(self, op: str, args: tuple, ints: tuple) -> bool:
        """torch.ops.overlap.<op>(*args); False, having written nothing, when the op refuses the
        call or `ints` holds something other than a plain int (which the op would not refuse
        but fail on with a RuntimeError)."""
        if not _ints(*ints):
            return False
        try:
            getattr(self._ops, op)(*args)
        except _REFUSED:
            return False
        return True

    def _pack(self, srcs: list[torch.Tensor], dst: torch.Tensor, offsets: list[int], scale: float) -> None:
        self._ops.pack(srcs, dst, offsets, scale)

    def _accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float, num_chunks: int) -> None:
        self._ops.accumulate(dst, src, scale, num_chunks)

    def _quantize_kernel(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                         error: Optional[torch.Tensor], block: int, bits: int) -> None:
        self._ops.quantize(src, q, scales, error, block, bits)

    def _dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                               bits: int, chunks: int) -> None:
        self._ops.dequantize_accumulate(dst, q, scales, block, bits, chunks)

    def _dequantize_into_kernel(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                                bits: int) -> None:
        self._ops.dequantize_into(dst, q, scales, block, bits)
