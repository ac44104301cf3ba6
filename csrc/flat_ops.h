// Argument checks and dtype codes shared by the CPU and CUDA implementations of the
// `torch.ops.overlap` flat-buffer ops (see kernels/flat_kernels.cu for their semantics).
// A refused call raises ValueError (bad arguments) or TypeError (a dtype the kernels do not
// cover) in Python, never RuntimeError: the `ext` backend hands exactly those calls to its
// checked path, and lets a RuntimeError (a CUDA fault, a missing kernel image) through.
#pragma once

#include <ATen/core/Tensor.h>

namespace overlap {

// Dtype codes, in the order kernels/flat_kernels.cu names its entry points.
enum class FlatDtype : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline FlatDtype flat_dtype(const at::Tensor& t, const char* op, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return FlatDtype::kF32;
    case at::kHalf: return FlatDtype::kF16;
    case at::kBFloat16: return FlatDtype::kBF16;
    default:
      TORCH_CHECK_TYPE(false, "overlap::", op, ": ", what, " has dtype ", t.scalar_type(),
                  "; these kernels take float32, float16 and bfloat16");
  }
}

inline void check_flat(const at::Tensor& flat, const char* op, const char* what) {
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous(), "overlap::", op, ": ", what,
              " must be a contiguous 1-D tensor, got shape ", flat.sizes(), " with strides ", flat.strides());
  flat_dtype(flat, op, what);
}

// Every tensor fits in `flat` at its offset, on flat's device, with a supported dtype.
inline void check_regions(at::TensorList tensors, at::IntArrayRef offsets, const at::Tensor& flat, const char* op) {
  TORCH_CHECK_VALUE(tensors.size() == offsets.size(), "overlap::", op, ": ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(t.device() == flat.device(), "overlap::", op, ": tensor ", i, " is on ", t.device(),
                " but the flat buffer is on ", flat.device());
    TORCH_CHECK_VALUE(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), "overlap::", op, ": tensor ", i,
                " (", t.numel(), " elements at offset ", offsets[i], ") does not fit in a flat buffer of ",
                flat.numel(), " elements");
    flat_dtype(t, op, "a tensor");
  }
}

inline void check_accumulate(const at::Tensor& dst, const at::Tensor& src, int64_t num_chunks) {
  TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous(), "overlap::accumulate: dst and src must be contiguous");
  TORCH_CHECK_VALUE(src.device() == dst.device(), "overlap::accumulate: src is on ", src.device(), " but dst is on ",
              dst.device());
  TORCH_CHECK_VALUE(num_chunks >= 1 && src.numel() == num_chunks * dst.numel(), "overlap::accumulate: src has ",
              src.numel(), " elements, expected num_chunks (", num_chunks, ") x dst's ", dst.numel());
  flat_dtype(dst, "accumulate", "dst");
  flat_dtype(src, "accumulate", "src");
}

}  // namespace overlap
