"""The `cupy` backend: kernels/flat_kernels.cu compiled at run time by NVRTC through
`cupy.RawModule`, for installs whose `overlap._C` was built without CUDA.

Kernels run on torch's current stream of the tensors' device; pointers go to the kernels as
raw addresses, so bf16 tensors (which CuPy has no dtype for) need no conversion. The launch
shape follows csrc/flat_launch.cu.
"""
from __future__ import annotations

import functools
from importlib import resources
from typing import Callable, Optional

import numpy as np
import torch

from .compiled import CompiledKernels, device_table, group_by_dtype

THREADS = 256
# Each thread moves 4 elements per iteration (OVERLAP_VEC in flat_kernels.cu).
ELEMENTS_PER_BLOCK = THREADS * 4
# Blocks of one launch beyond this stride over their tensor instead of adding more blocks.
MAX_BLOCKS = 1 << 16
# gridDim.y, which indexes the tensors of one launch, stops at 65535.
MAX_TENSORS_PER_LAUNCH = 65535
# The quantize kernels run one warp per quantisation block.
WARPS_PER_BLOCK = THREADS // 32

_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _import_cupy():
    import cupy

    return cupy


@functools.lru_cache(maxsize=None)
def _module(device_index: int):
    """flat_kernels.cu compiled for one device (NVRTC targets the device's architecture)."""
    cupy = _import_cupy()
    source = resources.files(__package__).joinpath("flat_kernels.cu").read_text()
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=source, options=("--std=c++17",))


def _blocks(numel: int, tensors: int) -> int:
    return max(1, min(-(-numel // ELEMENTS_PER_BLOCK), MAX_BLOCKS // max(tensors, 1)))


def _blocks_for_pairs(numel: int) -> int:
    return max(1, min(-(-((numel + 1) // 2) // THREADS), MAX_BLOCKS))


class CupyKernels(CompiledKernels):
    name = "cupy"

    def __init__(self) -> None:
        self._cupy = _import_cupy()

    def supports(self, device: torch.device) -> bool:
        device = torch.device(device)
        return device.type == "cuda" and torch.cuda.is_available() and self._cupy.cuda.is_available()

    def _launch(self, device: torch.device, kernel_name: str, grid: tuple[int, ...], args: tuple) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = _module(index).get_function(kernel_name)
        stream = self._cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index)
        with self._cupy.cuda.Device(index), stream:
            kernel(grid, (THREADS,), args)

    def _pack(self, srcs: list[torch.Tensor], dst: torch.Tensor, offsets: list[int], scale: float) -> None:
        apply_scale = np.int32(scale != 1.0)
        if len(srcs) == 1:
            # The runtime's per-step casts: one tensor needs no table (and no host-to-device copy).
            src = srcs[0].contiguous()
            if src.numel() > 0:
                target = dst[offsets[0]:]
                self._launch(dst.device, f"pack_one_{_DTYPE_NAMES[src.dtype]}_{_DTYPE_NAMES[dst.dtype]}",
                             (_blocks(src.numel(), 1),),
                             (np.uint64(src.data_ptr()), np.uint64(target.data_ptr()), np.int64(src.numel()),
                              np.float32(scale), apply_scale))
            return
        for dtype, (tensors, group_offsets) in group_by_dtype(srcs, offsets).items():
            name = f"pack_many_{_DTYPE_NAMES[dtype]}_{_DTYPE_NAMES[dst.dtype]}"
            self._launch_many(name, tensors, group_offsets, dst.device,
                              lambda table, count: (np.uint64(table.data_ptr()), np.int32(count),
                                                    np.uint64(dst.data_ptr()), np.float32(scale), apply_scale))

    def _launch_many(self, name: str, tensors: list[torch.Tensor], offsets: list[int], device: torch.device,
                     args_for: Callable[[torch.Tensor, int], tuple]) -> None:
        for lo in range(0, len(tensors), MAX_TENSORS_PER_LAUNCH):
            batch, batch_offsets = tensors[lo:lo + MAX_TENSORS_PER_LAUNCH], offsets[lo:lo + MAX_TENSORS_PER_LAUNCH]
            largest = max(t.numel() for t in batch)
            if largest == 0:
                continue
            table = device_table(batch, batch_offsets, device)
            # `table` stays referenced until the launch is queued; the caching allocator
            # orders its reuse after this stream's work.
            self._launch(device, name, (_blocks(largest, len(batch)), len(batch)), args_for(table, len(batch)))

    def _accumulate(self, dst: torch.Tensor, src: torch.Tensor, scale: float, num_chunks: int) -> None:
        name = f"accumulate_{_DTYPE_NAMES[src.dtype]}_{_DTYPE_NAMES[dst.dtype]}"
        self._launch(dst.device, name, (_blocks(dst.numel(), 1),),
                     (np.uint64(dst.data_ptr()), np.uint64(src.data_ptr()), np.int64(dst.numel()),
                      np.int32(num_chunks), np.float32(scale), np.int32(scale != 1.0)))

    # Quantised ops: launch shapes as in csrc/flat_launch.cu (quantize: one warp per
    # quantisation block; dequantize: one thread per element pair).

    def _quantize_kernel(self, src: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                         error: Optional[torch.Tensor], block: int, bits: int) -> None:
        n = src.numel()
        grid = (max(1, min(-(-scales.numel() // WARPS_PER_BLOCK), MAX_BLOCKS)),)
        self._launch(src.device, f"quantize_{_DTYPE_NAMES[src.dtype]}_b{bits}", grid,
                     (np.uint64(src.data_ptr()), np.uint64(0 if error is None else error.data_ptr()),
                      np.uint64(q.data_ptr()), np.uint64(scales.data_ptr()), np.int64(n), np.int32(block)))

    def _dequantize_accumulate(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                               bits: int, chunks: int) -> None:
        n = dst.numel()
        self._launch(dst.device, f"dequantize_accumulate_b{bits}", (_blocks_for_pairs(n),),
                     (np.uint64(dst.data_ptr()), np.uint64(q.data_ptr()), np.uint64(scales.data_ptr()), np.int64(n),
                      np.int32(block), np.int32(chunks)))

    def _dequantize_into_kernel(self, dst: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int,
                                bits: int) -> None:
        n = dst.numel()
        self._launch(dst.device, f"dequantize_into_{_DTYPE_NAMES[dst.dtype]}_b{bits}", (_blocks_for_pairs(n),),
                     (np.uint64(dst.data_ptr()), np.uint64(q.data_ptr()), np.uint64(scales.data_ptr()), np.int64(n),
                      np.int32(block)))

