"""The `triton` backend: the flat-buffer ops as Triton kernels.

Runs on CUDA tensors, and on CPU tensors when Triton's interpreter is on (the kernels are
built for whichever mode `triton.knobs.runtime.interpret` selects when this module is first
imported, e.g. from TRITON_INTERPRET=1). Every value is converted through float32; the
fp32 -> bf16 rounding is written out (round to nearest even, as torch) because the
interpreter's own cast truncates.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .compiled import CompiledKernels, device_table, group_by_dtype
from .quantized import QMAX, ROUNDING_MAGIC, num_blocks

# Elements per program and iteration.
BLOCK = 1024
# Upper bound on the programs of one multi-tensor launch; more work loops inside a program.
MAX_PROGRAMS = 1 << 16
# gridDim.y, which indexes the tensors of one launch, stops at 65535.
MAX_TENSORS_PER_LAUNCH = 65535

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """float32 `x` to DTYPE, rounding to nearest even."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _copy_block(src, dst, offs, mask, scale, APPLY_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """dst[offs] = cast(src[offs] * scale); the mask is used only for a tensor's last block."""
    if MASKED:
        x = tl.load(src + offs, mask=mask).to(tl.float32)
    else:
        x = tl.load(src + offs).to(tl.float32)
    if APPLY_SCALE:
        x = x * scale
    if MASKED:
        tl.store(dst + offs, _cast(x, dst.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + offs, _cast(x, dst.dtype.element_ty))


@triton.jit
def _copy_one_kernel(src, dst, n, scale, BLOCK: tl.constexpr, APPLY_SCALE: tl.constexpr):
    """One tensor: program p moves elements [p * BLOCK, (p + 1) * BLOCK); only the last is masked."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _copy_block(src, dst, offs, offs < n, scale, APPLY_SCALE, False)
    else:
        _copy_block(src, dst, offs, offs < n, scale, APPLY_SCALE, True)


@triton.jit
def _pack_many_kernel(table, count, flat, scale, SRC_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                      APPLY_SCALE: tl.constexpr):
    """Many tensors into one flat buffer. `table` holds int64 rows [address..., numel..., offset...]
    of `count` source tensors of dtype SRC_DTYPE. Program (g, t) moves tensor t's full blocks
    g, g + G, g + 2G, ... (G = programs along axis 0) to `flat` at its offset; program (0, t)
    also moves its masked tail."""
    t = tl.program_id(1)
    g = tl.program_id(0)
    programs = tl.num_programs(0)
    address = tl.load(table + t)
    n = tl.load(table + count + t)
    offset = tl.load(table + 2 * count + t)
    src = address.to(tl.pointer_type(SRC_DTYPE))
    dst = flat + offset
    full = (n // BLOCK) * BLOCK
    for start in range(g * BLOCK, full, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        _copy_block(src, dst, offs, offs < n, scale, APPLY_SCALE, False)
    if g == 0:
        offs = full + tl.arange(0, BLOCK)
        _copy_block(src, dst, offs, offs < n, scale, APPLY_SCALE, True)


@triton.jit
def _accumulate_block(dst, src, n, chunks, offs, mask, scale, APPLY_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """dst[offs] += cast(scale * sum_c src[c * n + offs]); the mask is used only for the last block.

    The pointers move `n` elements per chunk instead of adding `c * n`: with `n` below 2**31
    both are 32-bit and their product wraps once chunks * n reaches 2**31."""
    chunk = src + offs
    if MASKED:
        total = tl.load(chunk, mask=mask).to(tl.float32)
        for _ in range(1, chunks):
            chunk += n
            total += tl.load(chunk, mask=mask).to(tl.float32)
    else:
        total = tl.load(chunk).to(tl.float32)
        for _ in range(1, chunks):
            chunk += n
            total += tl.load(chunk).to(tl.float32)
    if APPLY_SCALE:
        total = total * scale
    dtype = dst.dtype.element_ty
    if MASKED:
        current = tl.load(dst + offs, mask=mask).to(tl.float32)
        tl.store(dst + offs, _cast(current + _cast(total, dtype).to(tl.float32), dtype), mask=mask)
    else:
        current = tl.load(dst + offs).to(tl.float32)
        tl.store(dst + offs, _cast(current + _cast(total, dtype).to(tl.float32), dtype))


@triton.jit
def _accumulate_kernel(dst, src, n, chunks, scale, BLOCK: tl.constexpr, APPLY_SCALE: tl.constexpr):
    """dst[i] += cast(scale * sum_c src[c * n + i]), chunks summed in order in float32. A 16-bit
    dst rounds the sum to its dtype first, then the addition, as `dst.add_(total.to(dtype))`.
    Program p handles elements [p * BLOCK, (p + 1) * BLOCK); only the last is masked."""
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:
        _accumulate_block(dst, src, n, chunks, offs, offs < n, scale, APPLY_SCALE, False)
    else:
        _accumulate_block(dst, src, n, chunks, offs, offs < n, scale, APPLY_SCALE, True)


# ---- Block-quantised communication (semantics and layout: kernels/quantized.py) -------------
# Every program handles element pairs (2p, 2p + 1), so the packed 4-bit byte p is written by
# the program that computed both its nibbles; blocks are even, so a pair never straddles two.

# Element pairs per program of the dequantize kernels.
DEQUANT_PAIRS = 512
# Element pairs per program of the quantize kernel: QUANT_PAIRS // HALF quantisation blocks of
# HALF pairs each (HALF = block / 2 rounded up to a power of two, masked).
QUANT_PAIRS = 1024


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


# tl.max is itself a jit function, which Triton's interpreter cannot call when it was switched
# on after triton's import (as the tests do); tl.reduce with tl.max's own combine function runs
# in both modes, and the interpreter reduces it with numpy instead of calling it per element
# (20x faster). Our own combine function stands in should that private name go.
_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)


@triton.jit
def _quantize_value(x, scale, QMAX: tl.constexpr, MAGIC: tl.constexpr):
    """round_half_even(clamp(x / scale, -QMAX, QMAX)) where scale > 0, else 0 (a block of zeros,
    or a NaN scale). (y + MAGIC) - MAGIC rounds |y| < 2**22 to nearest even."""
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    y = (y + MAGIC) - MAGIC
    return tl.where(scale > 0, y, 0.0)


@triton.jit
def _quantize_kernel(src, error, q, scales, n, block, num_blocks, QMAX: tl.constexpr, MAGIC: tl.constexpr,
                     BITS: tl.constexpr, HAS_ERROR: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr):
    """Program p quantises blocks [p * ROWS, (p + 1) * ROWS) as a [ROWS, HALF] tile of element
    pairs (x0 = element 2j of the block, x1 = element 2j + 1); pairs past the block or past n are
    masked and read as 0, which leaves the absmax alone and packs a 0 nibble. The absmax is a
    max of the bit patterns with the sign cleared: integer order is float order for non-negative
    floats, and inf and NaN come out >= 0x7F800000, which gives the block a NaN scale."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, HALF)
    i0 = rows[:, None] * block + 2 * pairs[None, :]
    m0 = (2 * pairs[None, :] < block) & (i0 < n)
    m1 = (2 * pairs[None, :] < block) & (i0 + 1 < n)
    x0 = tl.load(src + i0, mask=m0, other=0.0).to(tl.float32)
    x1 = tl.load(src + i0 + 1, mask=m1, other=0.0).to(tl.float32)
    if HAS_ERROR:
        x0 = x0 + tl.load(error + i0, mask=m0, other=0.0)
        x1 = x1 + tl.load(error + i0 + 1, mask=m1, other=0.0)
    bits = tl.maximum(x0.to(tl.int32, bitcast=True) & 0x7FFFFFFF, x1.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    absmax_bits = tl.reduce(bits, 1, _MAX)
    nan = tl.full([ROWS], 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(absmax_bits >= 0x7F800000, nan, tl.math.div_rn(absmax_bits.to(tl.float32, bitcast=True), QMAX))
    tl.store(scales + rows, scale, mask=rows < num_blocks)
    q0 = _quantize_value(x0, scale[:, None], QMAX, MAGIC)
    q1 = _quantize_value(x1, scale[:, None], QMAX, MAGIC)
    if HAS_ERROR:
        tl.store(error + i0, x0 - q0 * scale[:, None], mask=m0)
        tl.store(error + i0 + 1, x1 - q1 * scale[:, None], mask=m1)
    if BITS == 8:
        tl.store(q + i0, q0.to(tl.int8), mask=m0)
        tl.store(q + i0 + 1, q1.to(tl.int8), mask=m1)
    else:
        packed = (q0.to(tl.int32) & 0xF) | ((q1.to(tl.int32) & 0xF) << 4)
        tl.store(q + i0 // 2, packed.to(tl.uint8), mask=m0)


@triton.jit
def _dequantize_kernel(dst, q, scales, n, block, chunks, chunk_bytes, num_blocks, BITS: tl.constexpr,
                       ACCUMULATE: tl.constexpr, PAIRS: tl.constexpr):
    """Program p handles element pairs [p * PAIRS, (p + 1) * PAIRS). Per chunk c (its q starts
    c * chunk_bytes bytes in, its scales c * num_blocks in): total += q * scale, from -0.0 (the
    exact identity of `+`), in chunk order. ACCUMULATE: fp32 dst += total; otherwise dst =
    cast(total) of the single chunk. 4-bit nibbles are sign-extended by arithmetic shifts."""
    pairs = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)
    i0 = 2 * pairs
    m0 = i0 < n
    m1 = i0 + 1 < n
    block_index = i0 // block
    total0 = tl.full([PAIRS], -0.0, tl.float32)
    total1 = tl.full([PAIRS], -0.0, tl.float32)
    q_chunk = q
    scales_chunk = scales
    for _ in range(chunks):
        if BITS == 8:
            v0 = tl.load(q_chunk + i0, mask=m0, other=0).to(tl.float32)
            v1 = tl.load(q_chunk + i0 + 1, mask=m1, other=0).to(tl.float32)
        else:
            byte = tl.load(q_chunk + pairs, mask=m0, other=0).to(tl.int32)
            v0 = ((byte << 28) >> 28).to(tl.float32)
            v1 = ((byte << 24) >> 28).to(tl.float32)
        scale = tl.load(scales_chunk + block_index, mask=m0, other=0.0)
        total0 = total0 + v0 * scale
        total1 = total1 + v1 * scale
        q_chunk += chunk_bytes
        scales_chunk += num_blocks
    if ACCUMULATE:
        tl.store(dst + i0, tl.load(dst + i0, mask=m0) + total0, mask=m0)
        tl.store(dst + i0 + 1, tl.load(dst + i0 + 1, mask=m1) + total1, mask=m1)
    else:
        tl.store(dst + i0, _cast(total0, dst.dtype.element_ty), mask=m0)
        tl.store(dst + i0 + 1, _cast(total1, dst.dtype.element_ty), mask=m1)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launches go to the current CUDA device: make it `device`'s."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _interpreted() -> bool:
    """Whether this module's kernels were built for Triton's interpreter (CPU tensors)."""
    return isinstance(_copy_one_kernel, InterpretedFunction)


class TritonKernels(CompiledKernels):
    name = "triton"

    def __init__(self) -> None:
        # Compiled kernels must not fuse `a + b * s` into one FMA: torch rounds the product first.
        self._options = {} if _interpreted() else {"enable_fp_fusion": False}

    def supports(self, device: torch.device) -> bool:
        device = torch.device(device)
        if device.type == "cpu":
            return _interpreted()
        return device.type == "cuda" and not _interpreted() and torch.cuda.is_available()

    def _pack(self, srcs: list[torch.Tensor], dst: torch.Tensor, offsets: list[int], scale: float) -> None:
        if len(srcs) == 1:
            # The runtime's per-step casts: one tensor needs no table (and no host-to-device copy).
            src = srcs[0].contiguous()
            self._copy_one(src.reshape(-1), dst[offsets[0]:offsets[0] + src.numel()], scale)
            return
        for dtype, (tensors, group_offsets) in group_by_dtype(srcs, offsets).items():
            self._pack_many(tensors, group_offsets, dst, dtype, scale)

    def _accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float, num_chunks: int) -> None:
        n = dst.numel()
        with _on(dst.device):
            _accumulate_kernel[(triton.cdiv(n, BLOCK),)](dst, src, n, num_chunks, scale, BLOCK=BLOCK,
                                                         APPLY_SCALE=scale != 1.0, **self._options)

    def _copy_one(self, src: torch.Tensor, dst: torch.Tensor, scale: float) -> None:
        n = src.numel()
        if n == 0:
            return
        with _on(dst.device):
            _copy_one_kernel[(triton.cdiv(n, BLOCK),)](src, dst, n, scale, BLOCK=BLOCK, APPLY_SCALE=scale != 1.0,
                                                       **self._options)

    def _pack_many(self, tensors: list[torch.Tensor], offsets: list[int], flat: torch.Tensor, dtype: torch.dtype,
                   scale: float) -> None:
        for lo in range(0, len(tensors), MAX_TENSORS_PER_LAUNCH):
            batch, batch_offsets = tensors[lo:lo + MAX_TENSORS_PER_LAUNCH], offsets[lo:lo + MAX_TENSORS_PER_LAUNCH]
            largest = max(t.numel() for t in batch)
            if largest == 0:
                continue
            table = device_table(batch, batch_offsets, flat.device)
            programs = max(1, min(triton.cdiv(largest, BLOCK), MAX_PROGRAMS // len(batch)))
            with _on(flat.device):
                _pack_many_kernel[(programs, len(batch))](table, len(batch), flat, scale, SRC_DTYPE=_TL_DTYPES[dtype],
                                                          BLOCK=BLOCK, APPLY_SCALE=scale != 1.0, **self._options)

    def _quantize_kernel(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                         error: Optional[torch.Tensor], block: int, bits: int) -> None:
        half = triton.next_power_of_2(block // 2)
        rows = max(1, QUANT_PAIRS // half)
        n, nb = src.numel(), scales.numel()
        with _on(src.device):
            # Without error feedback, `error` is never read: any pointer stands in.
            _quantize_kernel[(triton.cdiv(nb, rows),)](
                src, scales if error is None else error, q, scales, n, block, nb, QMAX=float(QMAX[bits]),
                MAGIC=ROUNDING_MAGIC, BITS=bits, HAS_ERROR=error is not None, ROWS=rows, HALF=half,
                **self._options)

    def _dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                               bits: int, chunks: int) -> None:
        self._dequantize(dst, q, scales, block, bits, chunks, accumulate=True)

    def _dequantize_into_kernel(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                                bits: int) -> None:
        self._dequantize(dst, q, scales, block, bits, 1, accumulate=False)

    def _dequantize(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int, bits: int,
                    chunks: int, accumulate: bool) -> None:
        n = dst.numel()
        with _on(dst.device):
            _dequantize_kernel[(triton.cdiv((n + 1) // 2, DEQUANT_PAIRS),)](
                dst, q, scales, n, block, chunks, q.numel() // chunks, num_blocks(n, block), BITS=bits,
                ACCUMULATE=accumulate, PAIRS=DEQUANT_PAIRS, **self._options)
