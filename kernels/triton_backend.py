"""The `triton` backend: the flat-buffer ops as Triton kernels.

Runs on CUDA tensors, and on CPU tensors when Triton's interpreter is on (the kernels are
built for whichever mode `triton.knobs.runtime.interpret` selects when this module is first
imported, e.g. from TRITON_INTERPRET=1). Every value is converted through float32; the
fp32 -> bf16 rounding is written out (round to nearest even, as torch) because the
interpreter's own cast truncates.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .compiled import CompiledKernels, device_table, group_by_dtype

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
def _copy_many_kernel(table, count, flat, scale, OTHER_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                      PACK: tl.constexpr, APPLY_SCALE: tl.constexpr):
    """Many tensors and one flat buffer. `table` holds int64 rows [address..., numel..., offset...]
    of `count` tensors of dtype OTHER_DTYPE. Program (g, t) moves tensor t's full blocks
    g, g + G, g + 2G, ... (G = programs along axis 0); program (0, t) also moves its masked tail.
    PACK copies tensors into `flat` at their offsets, otherwise `flat` into the tensors."""
    t = tl.program_id(1)
    g = tl.program_id(0)
    programs = tl.num_programs(0)
    address = tl.load(table + t)
    n = tl.load(table + count + t)
    offset = tl.load(table + 2 * count + t)
    if PACK:
        src = address.to(tl.pointer_type(OTHER_DTYPE))
        dst = flat + offset
    else:
        src = flat + offset
        dst = address.to(tl.pointer_type(OTHER_DTYPE))
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
            self._copy_many(tensors, group_offsets, dst, dtype, scale, pack=True)

    def _unpack(self, src: torch.Tensor, dsts: list[torch.Tensor], offsets: list[int]) -> None:
        if len(dsts) == 1:
            dst = dsts[0]
            self._copy_one(src[offsets[0]:offsets[0] + dst.numel()], dst.view(-1), 1.0)
            return
        for dtype, (tensors, group_offsets) in group_by_dtype(dsts, offsets).items():
            self._copy_many(tensors, group_offsets, src, dtype, 1.0, pack=False)

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

    def _copy_many(self, tensors: list[torch.Tensor], offsets: list[int], flat: torch.Tensor, dtype: torch.dtype,
                   scale: float, pack: bool) -> None:
        for lo in range(0, len(tensors), MAX_TENSORS_PER_LAUNCH):
            batch, batch_offsets = tensors[lo:lo + MAX_TENSORS_PER_LAUNCH], offsets[lo:lo + MAX_TENSORS_PER_LAUNCH]
            largest = max(t.numel() for t in batch)
            if largest == 0:
                continue
            table = device_table(batch, batch_offsets, flat.device)
            programs = max(1, min(triton.cdiv(largest, BLOCK), MAX_PROGRAMS // len(batch)))
            with _on(flat.device):
                _copy_many_kernel[(programs, len(batch))](table, len(batch), flat, scale, OTHER_DTYPE=_TL_DTYPES[dtype],
                                                          BLOCK=BLOCK, PACK=pack, APPLY_SCALE=scale != 1.0,
                                                          **self._options)

