"""Plain torch implementation of the flat-buffer kernels: the source of truth.

Every other backend is tested element for element against these functions.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .quantized import QMAX, ROUNDING_MAGIC, QuantizedOps, num_blocks


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic is done in: float64 stays, everything else goes to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class TorchKernels(QuantizedOps):
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

    def accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0, num_chunks: int = 1) -> None:
        """dst += scale * src.view(num_chunks, dst.numel()).sum(0), summed in float32 (or float64)."""
        chunks = src.view(num_chunks, dst.numel()).to(_wide(dst.dtype))
        total = chunks[0] if num_chunks == 1 else chunks.sum(0)
        if scale != 1.0:
            total = total * scale
        dst.add_(total.to(dst.dtype).view(dst.shape))

    # ---- block quantisation (semantics: kernels/quantized.py) ------------------------------

    def _quantize(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, error: Optional[torch.Tensor],
                  block: int, bits: int) -> None:
        """Per block of x = float32(src) (+ error): scale = absmax / qmax (NaN if the block
        holds inf or NaN), q = round_half_even(clamp(x / scale, -qmax, qmax)) where scale > 0,
        else 0; error = x - q * scale."""
        qmax = QMAX[bits]
        n, nb = src.numel(), scales.numel()
        x = src.to(torch.float32)
        if error is not None:
            x = x + error
        x_BK = F.pad(x, (0, nb * block - n)).view(nb, block)  # padding: zeros, q = 0
        absmax_B = x_BK.abs().amax(1)
        scale_B = torch.where(x_BK.isfinite().all(1), absmax_B / qmax, float("nan"))
        y_BK = (x_BK / scale_B[:, None]).clamp_(-qmax, qmax)
        y_BK = (y_BK + ROUNDING_MAGIC) - ROUNDING_MAGIC  # torch.round's rounding, as the kernels write it
        q_BK = torch.where((scale_B > 0)[:, None], y_BK, 0.0)
        scales.copy_(scale_B)
        if error is not None:
            error.copy_((x_BK - q_BK * scale_B[:, None]).view(-1)[:n])
        q_N = q_BK.view(-1)[:n].to(torch.int8)
        if bits == 8:
            q.copy_(q_N)
            return
        q_N = F.pad(q_N, (0, n % 2))
        q.copy_(((q_N[0::2] & 0xF) | (q_N[1::2] << 4)).view(torch.uint8))

    def _dequantized(self, q: torch.Tensor, scales: torch.Tensor, n: int, block: int, bits: int,
                     chunks: int) -> torch.Tensor:
        """float32 [chunks, n]: every chunk's q * scale."""
        nb = num_blocks(n, block)
        if bits == 8:
            q_CN = q.view(chunks, n)
        else:
            bytes_CP = q.view(torch.int8).view(chunks, -1)
            # Arithmetic shifts sign-extend each nibble.
            q_CN = torch.stack(((bytes_CP << 4) >> 4, bytes_CP >> 4), dim=2).view(chunks, -1)[:, :n]
        q_CBK = F.pad(q_CN.to(torch.float32), (0, nb * block - n)).view(chunks, nb, block)
        return (q_CBK * scales.view(chunks, nb, 1)).view(chunks, -1)[:, :n]

    def _dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                               bits: int, chunks: int) -> None:
        """total = d_0 + d_1 + ... (chunk order, fp32), then dst += total."""
        d_CN = self._dequantized(q, scales, dst.numel(), block, bits, chunks)
        total = d_CN[0]
        for c in range(1, chunks):
            total = total + d_CN[c]
        dst.add_(total)

    def _dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                         bits: int) -> None:
        dst.copy_(self._dequantized(q, scales, dst.numel(), block, bits, 1)[0])
