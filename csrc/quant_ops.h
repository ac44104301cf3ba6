// Layout and argument checks shared by the CPU and CUDA implementations of the quantised ops
// `torch.ops.overlap.{quantize,dequantize_accumulate,dequantize_into}` (semantics and layout:
// kernels/quantized.py). As in flat_ops.h, a refused call raises ValueError or TypeError.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "flat_ops.h"

namespace overlap {

// MAX_BLOCK in kernels/quantized.py: the CPU kernels keep one block in stack buffers.
constexpr int64_t kMaxQuantBlock = 4096;

inline int64_t quant_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }
inline int64_t quant_bytes(int64_t n, int64_t bits) { return bits == 8 ? n : (n + 1) / 2; }
inline at::ScalarType quant_dtype(int64_t bits) { return bits == 8 ? at::kChar : at::kByte; }

inline void check_quant_layout(const char* op, int64_t block, int64_t bits) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "overlap::", op, ": bits=", bits, " is invalid; expected 8 or 4");
  TORCH_CHECK_VALUE(block >= 2 && block <= kMaxQuantBlock && block % 2 == 0, "overlap::", op, ": block=", block,
                    " is invalid; expected an even integer from 2 to ", kMaxQuantBlock);
}

inline void check_quant_tensor(const char* op, const char* what, const at::Tensor& t, at::ScalarType dtype,
                               int64_t numel, const at::Device& device) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), "overlap::", op, ": ", what,
                    " must be a contiguous 1-D tensor, got shape ", t.sizes(), " with strides ", t.strides());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "overlap::", op, ": ", what, " has dtype ", t.scalar_type(),
                   "; expected ", dtype);
  TORCH_CHECK_VALUE(t.numel() == numel, "overlap::", op, ": ", what, " has ", t.numel(), " elements; expected ",
                    numel);
  TORCH_CHECK_VALUE(t.device() == device, "overlap::", op, ": ", what, " is on ", t.device(), ", not ", device);
}

inline void check_quantize(const at::Tensor& src, const at::Tensor& q, const at::Tensor& scales,
                           const std::optional<at::Tensor>& error, int64_t block, int64_t bits) {
  check_quant_layout("quantize", block, bits);
  check_flat(src, "quantize", "src");
  const int64_t n = src.numel();
  check_quant_tensor("quantize", "q", q, quant_dtype(bits), quant_bytes(n, bits), src.device());
  check_quant_tensor("quantize", "scales", scales, at::kFloat, quant_blocks(n, block), src.device());
  if (error.has_value()) check_quant_tensor("quantize", "error", *error, at::kFloat, n, src.device());
}

// `accumulate`: dst must be float32 (dequantize_accumulate); otherwise any kernel dtype (dequantize_into).
inline void check_dequantize(const char* op, const at::Tensor& dst, const at::Tensor& q, const at::Tensor& scales,
                             int64_t block, int64_t bits, int64_t chunks, bool accumulate) {
  check_quant_layout(op, block, bits);
  TORCH_CHECK_VALUE(chunks >= 1, "overlap::", op, ": chunks=", chunks, " is invalid; expected an integer >= 1");
  if (accumulate) {
    check_quant_tensor(op, "dst", dst, at::kFloat, dst.numel(), dst.device());
  } else {
    check_flat(dst, op, "dst");
  }
  const int64_t n = dst.numel();
  check_quant_tensor(op, "q", q, quant_dtype(bits), chunks * quant_bytes(n, bits), dst.device());
  check_quant_tensor(op, "scales", scales, at::kFloat, chunks * quant_blocks(n, block), dst.device());
}

}  // namespace overlap
