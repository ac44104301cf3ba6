"""Block-quantised communication: the layout, the argument checks and the four public ops.

A flat fp32/bf16/fp16 buffer of ``n`` elements is cut into blocks of ``block`` consecutive
elements (the last one may be short). Each block gets one fp32 scale and one small integer
per element, symmetric around zero:

- ``bits=8``: ``scale = absmax / 127``, ``q = round_half_even(x / scale)`` clamped to
  [-127, 127], one int8 per element (``q`` is int8 [n]).
- ``bits=4``: ``scale = absmax / 7``, range [-7, 7], two elements per byte, element ``2j`` in
  the low nibble of byte ``j`` and ``2j + 1`` in its high nibble (``q`` is uint8
  [ceil(n / 2)]; an odd ``n`` leaves the last high nibble 0).

``scales`` is fp32 [ceil(n / block)]; a value dequantises to ``q * scale`` in fp32.
Several chunks of ``n`` elements, each quantised on its own (what an all-to-all delivers:
one chunk per rank), lie chunk after chunk: chunk ``c``'s bytes and scales follow chunk
``c - 1``'s in ``q`` and ``scales``.

[Note: non-finite values]
A block whose values (after the error is added) hold an inf or a NaN gets a NaN scale and
``q = 0`` everywhere, so the whole block, and only that block, dequantises to NaN: a sum
that receives it shows the overflow where it happened, and no other block's scale or values
change. With error feedback, that block's ``error`` entries become NaN as well (the formula
``x - q * scale`` gives NaN); a caller that skips a step for non-finite gradients resets the
error buffer with it. A block of zeros gets scale 0 and ``q = 0``; so does a block whose
scale underflows to 0.

Every backend computes the same fp32 operations in the same order (see the reference in
reference.py), so results agree bit for bit. Rounding to nearest even adds and subtracts
ROUNDING_MAGIC, exact for the clamped values (|y| <= 127 < 2**22), and needs no rounding
instruction that one backend or another lacks.
"""
from __future__ import annotations

from typing import Optional

import torch

# Chosen by measurement (docs/kernels.md, `benchmarks/kernel_bandwidth.py --quant-blocks`). One more bit
# per element halves the error, so halving the block pays when log2(error ratio) beats the
# 32 / block bits its extra scales cost. The best block is 256 on normal values and 64 on
# heavy-tailed ones (Student-t, 3 degrees of freedom); 128 is within 0.1 bit per element of
# the best on both, for int8 and int4, at 3 % extra bytes for int8 (6 % for int4).
DEFAULT_BLOCK = 128
# Largest block: the compiled kernels keep a block's values in registers or a stack buffer.
MAX_BLOCK = 4096
QMAX = {8: 127, 4: 7}
Q_DTYPES = {8: torch.int8, 4: torch.uint8}
# 1.5 * 2**23: (y + M) - M rounds a float32 |y| < 2**22 to the nearest integer, ties to even.
ROUNDING_MAGIC = 12582912.0


def num_blocks(numel: int, block: int) -> int:
    """Scales for `numel` elements: ceil(numel / block)."""
    return -(-numel // block)


def quantized_bytes(numel: int, bits: int) -> int:
    """Bytes of `q` for `numel` elements: numel for 8 bits, ceil(numel / 2) for 4."""
    return numel if bits == 8 else (numel + 1) // 2


def empty_quantized(numel: int, block: int, bits: int, device: torch.device, chunks: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q, scales) buffers for `chunks` chunks of `numel` elements each."""
    _check_layout("empty_quantized", block, bits)
    return (torch.empty(chunks * quantized_bytes(numel, bits), dtype=Q_DTYPES[bits], device=device),
            torch.empty(chunks * num_blocks(numel, block), dtype=torch.float32, device=device))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_layout(op: str, block, bits) -> None:
    if bits not in QMAX or not _is_int(bits):
        raise ValueError(f"{op}: bits={bits!r} is invalid; expected 8 or 4")
    if not _is_int(block) or block < 2 or block > MAX_BLOCK or block % 2:
        raise ValueError(f"{op}: block={block!r} is invalid; expected an even integer from 2 to {MAX_BLOCK}")


def _check_flat(op: str, what: str, tensor: torch.Tensor, dtype: Optional[torch.dtype], numel: int,
                expected_numel: str, anchor: torch.Tensor, anchor_name: str) -> None:
    """`tensor` is contiguous, 1-D, of `dtype` (None: any float), with `numel` elements (the
    formula `expected_numel` says how many), on the device of `anchor` (src or dst)."""
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{op}: {what} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)} "
                         f"with strides {tensor.stride()}")
    if dtype is None and not tensor.is_floating_point():
        raise TypeError(f"{op}: {what} has dtype {tensor.dtype}; expected a floating-point dtype")
    if dtype is not None and tensor.dtype != dtype:
        raise TypeError(f"{op}: {what} has dtype {tensor.dtype}; expected {dtype}")
    if tensor.numel() != numel:
        raise ValueError(f"{op}: {what} has {tensor.numel()} elements; expected {expected_numel} = {numel}")
    if tensor.device != anchor.device:
        raise ValueError(f"{op}: {what} is on {tensor.device} but {anchor_name} is on {anchor.device}")


def check_quantize(op: str, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor,
                   error: Optional[torch.Tensor], block: int, bits: int) -> None:
    """ValueError or TypeError naming the argument unless a quantize call's arguments fit together."""
    _check_layout(op, block, bits)
    n = src.numel()
    _check_flat(op, "src", src, None, n, "n", src, "src")
    _check_flat(op, "out_q", out_q, Q_DTYPES[bits], quantized_bytes(n, bits), "n" if bits == 8 else "ceil(n / 2)",
                src, "src")
    _check_flat(op, "out_scales", out_scales, torch.float32, num_blocks(n, block),
                f"ceil(n / block) = ceil({n} / {block})", src, "src")
    if error is not None:
        _check_flat(op, "error", error, torch.float32, n, "n", src, "src")


def check_dequantize(op: str, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int, bits: int,
                     chunks: int) -> None:
    """ValueError or TypeError naming the argument unless a dequantize call's arguments fit together."""
    _check_layout(op, block, bits)
    if not _is_int(chunks) or chunks < 1:
        raise ValueError(f"{op}: chunks={chunks!r} is invalid; expected an integer >= 1")
    n = dst.numel()
    _check_flat(op, "dst", dst, torch.float32 if op == "dequantize_accumulate" else None, n, "n", dst, "dst")
    per_chunk = "n" if bits == 8 else "ceil(n / 2)"
    _check_flat(op, "q", q, Q_DTYPES[bits], chunks * quantized_bytes(n, bits),
                per_chunk if chunks == 1 else f"chunks ({chunks}) x {per_chunk}", dst, "dst")
    _check_flat(op, "scales", scales, torch.float32, chunks * num_blocks(n, block),
                f"chunks ({chunks}) x ceil(n / block) = {chunks} x ceil({n} / {block})", dst, "dst")


class QuantizedOps:
    """The public quantised ops of a backend: checks, then the backend's `_quantize`,
    `_dequantize_accumulate` and `_dequantize_into`, which see only arguments that fit and
    at least one element. Semantics: the module docstring."""

    def quantize_int8(self, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor, block: int,
                      error: Optional[torch.Tensor] = None) -> None:
        """Quantise `src` (1-D float) to int8 per block: out_q int8 [n], out_scales fp32
        [ceil(n / block)]. With `error` (fp32 [n]), `src + error` is quantised and `error`
        is overwritten with `src + error - dequantised` (error feedback). A block holding inf
        or NaN gets a NaN scale and q = 0 (it dequantises to NaN; no other block changes)."""
        check_quantize("quantize_int8", src, out_q, out_scales, error, block, 8)
        if src.numel():
            self._quantize(src, out_q, out_scales, error, block, 8)

    def quantize_int4(self, src: torch.Tensor, out_q: torch.Tensor, out_scales: torch.Tensor, block: int,
                      error: Optional[torch.Tensor] = None) -> None:
        """As quantize_int8 with range [-7, 7], scale = absmax / 7, and two values per byte
        (out_q uint8 [ceil(n / 2)], element 2j in byte j's low nibble). Same inf/NaN rule."""
        check_quantize("quantize_int4", src, out_q, out_scales, error, block, 4)
        if src.numel():
            self._quantize(src, out_q, out_scales, error, block, 4)

    def dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                              bits: int, chunks: int = 1) -> None:
        """dst (fp32 [n]) += the sum of `chunks` consecutive quantised chunks of n elements,
        dequantised, in fp32: total = d_0 + d_1 + ... in chunk order, then dst + total. A
        chunk's NaN block (see quantize_int8) makes those n-element positions NaN."""
        check_dequantize("dequantize_accumulate", dst, q, scales, block, bits, chunks)
        if dst.numel():
            self._dequantize_accumulate(dst, q, scales, block, bits, chunks)

    def dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                        bits: int) -> None:
        """dst[i] = (q[i] * scale) computed in fp32 and cast to dst's float dtype (round to
        nearest even); a NaN block writes NaN."""
        check_dequantize("dequantize_into", dst, q, scales, block, bits, 1)
        if dst.numel():
            self._dequantize_into(dst, q, scales, block, bits)

    # ---- implemented by each backend -------------------------------------------------------

    def _quantize(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, error: Optional[torch.Tensor],
                  block: int, bits: int) -> None:
        raise NotImplementedError

    def _dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                               bits: int, chunks: int) -> None:
        raise NotImplementedError

    def _dequantize_into(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                         bits: int) -> None:
        raise NotImplementedError
