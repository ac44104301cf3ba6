"""Plain torch implementation of the flat-buffer kernels: the source of truth.

Every other backend is tested element for element against these functions.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic is done in: float64 stays, everything else goes to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class TorchKernels:
    """Reference backend. Works on any device torch supports."""

    name = "torch"

    def supports(self, device: torch.device) -> bool:
        return True

    def pack(self, srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int],
             scale: float = 1.0) -> None:
        """dst[offsets[i] : offsets[i] + srcs[i].numel()] = (srcs[i] * scale) cast to dst.dtype.

        Regions of `dst` not covered by any source (padding) are left untouched.
        """
        for src, offset in zip(srcs, offsets):
            region = dst.narrow(0, offset, src.numel())
            flat = src.reshape(-1)
            if scale != 1.0:
                flat = flat.to(_wide(flat.dtype)) * scale
            region.copy_(flat)

    def unpack(self, src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
        """dsts[i] = src[offsets[i] : offsets[i] + dsts[i].numel()] viewed as dsts[i].shape, cast."""
        for dst, offset in zip(dsts, offsets):
            dst.copy_(src.narrow(0, offset, dst.numel()).view(dst.shape))

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, num_chunks: int = 1) -> None:
        """dst += scale * src.view(num_chunks, dst.numel()).sum(0), summed in float32 (or float64)."""
        chunks = src.view(num_chunks, dst.numel()).to(_wide(dst.dtype))
        total = chunks[0] if num_chunks == 1 else chunks.sum(0)
        if scale != 1.0:
            total = total * scale
        dst.add_(total.to(dst.dtype).view(dst.shape))
