// CUDA implementation of the quantised ops: argument checks and launches on the current stream
// (kernels: kernels/flat_kernels.cu; semantics: kernels/quantized.py). Compiled only when the
// build has CUDA (setup.py defines OVERLAP_WITH_CUDA).
#ifdef OVERLAP_WITH_CUDA

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flat_launch.h"
#include "quant_ops.h"

namespace overlap {
namespace {

void check_launch(int error) {
  C10_CUDA_CHECK(static_cast<cudaError_t>(error));
}

void quantize_cuda(const at::Tensor& src, const at::Tensor& q, const at::Tensor& scales,
                   const std::optional<at::Tensor>& error, int64_t block, int64_t bits) {
  check_quantize(src, q, scales, error, block, bits);
  const c10::cuda::CUDAGuard guard(src.device());
  check_launch(launch_quantize(static_cast<int>(flat_dtype(src, "quantize", "src")), static_cast<int>(bits),
                               src.const_data_ptr(), error.has_value() ? error->mutable_data_ptr<float>() : nullptr,
                               q.mutable_data_ptr(), scales.mutable_data_ptr<float>(), src.numel(),
                               static_cast<int>(block), c10::cuda::getCurrentCUDAStream().stream()));
}

void dequantize_accumulate_cuda(const at::Tensor& dst, const at::Tensor& q, const at::Tensor& scales, int64_t block,
                                int64_t bits, int64_t chunks) {
  check_dequantize("dequantize_accumulate", dst, q, scales, block, bits, chunks, /*accumulate=*/true);
  TORCH_CHECK_VALUE(chunks <= INT32_MAX, "overlap::dequantize_accumulate: chunks=", chunks, " is too large");
  const c10::cuda::CUDAGuard guard(dst.device());
  check_launch(launch_dequantize_accumulate(static_cast<int>(bits), dst.mutable_data_ptr<float>(), q.const_data_ptr(),
                                            scales.const_data_ptr<float>(), dst.numel(), static_cast<int>(block),
                                            static_cast<int>(chunks), c10::cuda::getCurrentCUDAStream().stream()));
}

void dequantize_into_cuda(const at::Tensor& dst, const at::Tensor& q, const at::Tensor& scales, int64_t block,
                          int64_t bits) {
  check_dequantize("dequantize_into", dst, q, scales, block, bits, 1, /*accumulate=*/false);
  const c10::cuda::CUDAGuard guard(dst.device());
  check_launch(launch_dequantize_into(static_cast<int>(flat_dtype(dst, "dequantize_into", "dst")),
                                      static_cast<int>(bits), dst.mutable_data_ptr(), q.const_data_ptr(),
                                      scales.const_data_ptr<float>(), dst.numel(), static_cast<int>(block),
                                      c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(overlap, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize_accumulate", &dequantize_accumulate_cuda);
  m.impl("dequantize_into", &dequantize_into_cuda);
}

}  // namespace overlap

#endif  // OVERLAP_WITH_CUDA
