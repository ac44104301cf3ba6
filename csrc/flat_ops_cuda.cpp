// CUDA implementation of the `torch.ops.overlap` flat-buffer ops: argument checks, tensor
// tables, and launches on the current stream (kernels: kernels/flat_kernels.cu).
// Compiled only when the build has CUDA (setup.py defines OVERLAP_WITH_CUDA).
#ifdef OVERLAP_WITH_CUDA

#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "flat_launch.h"
#include "flat_ops.h"

namespace overlap {
namespace {

// gridDim.y, which indexes the tensors of one launch, stops at 65535.
constexpr size_t kMaxTensorsPerLaunch = 65535;

void check_launch(int error) {
  C10_CUDA_CHECK(static_cast<cudaError_t>(error));
}

struct Region {
  const at::Tensor* tensor;  // contiguous, of one dtype within a launch
  int64_t offset;            // in the flat buffer, in elements
};

// The device table [address..., numel..., offset...] for `regions`. The host side is pinned
// so the copy is asynchronous; torch keeps the pinned block until the copy has run.
at::Tensor device_table(const std::vector<Region>& regions, const at::Device& device) {
  const int64_t count = static_cast<int64_t>(regions.size());
  at::Tensor host = at::empty({3 * count}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* rows = host.mutable_data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t) {
    rows[t] = reinterpret_cast<int64_t>(regions[t].tensor->const_data_ptr());
    rows[count + t] = regions[t].tensor->numel();
    rows[2 * count + t] = regions[t].offset;
  }
  return host.to(device, /*non_blocking=*/true);
}

// Calls launch(dtype, table, count, max_numel) once per dtype and per kMaxTensorsPerLaunch tensors.
template <typename Launch>
void launch_by_dtype(const std::vector<Region>& regions, const at::Device& device, const char* op,
                     Launch launch) {
  std::vector<Region> by_dtype[3];
  for (const Region& r : regions) by_dtype[static_cast<int>(flat_dtype(*r.tensor, op, "a tensor"))].push_back(r);
  for (int dtype = 0; dtype < 3; ++dtype) {
    const std::vector<Region>& all = by_dtype[dtype];
    for (size_t lo = 0; lo < all.size(); lo += kMaxTensorsPerLaunch) {
      std::vector<Region> batch(all.begin() + lo, all.begin() + std::min(all.size(), lo + kMaxTensorsPerLaunch));
      int64_t max_numel = 0;
      for (const Region& r : batch) max_numel = std::max(max_numel, r.tensor->numel());
      at::Tensor table = device_table(batch, device);
      launch(dtype, table.const_data_ptr<int64_t>(), static_cast<int>(batch.size()), max_numel);
    }
  }
}

void pack_cuda(at::TensorList srcs, const at::Tensor& dst, at::IntArrayRef offsets, double scale) {
  check_flat(dst, "pack", "dst");
  check_regions(srcs, offsets, dst, "pack");
  const c10::cuda::CUDAGuard guard(dst.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const int dst_dtype = static_cast<int>(flat_dtype(dst, "pack", "dst"));
  const int apply_scale = scale != 1.0;
  std::vector<at::Tensor> inputs;
  inputs.reserve(srcs.size());  // Region keeps pointers into it
  for (const at::Tensor& src : srcs) inputs.push_back(src.contiguous());
  if (inputs.size() == 1) {
    // The runtime's per-step casts: a single tensor needs no table (and no host-to-device copy).
    const at::Tensor& src = inputs[0];
    check_launch(launch_pack_one(static_cast<int>(flat_dtype(src, "pack", "a source")), dst_dtype,
                                 src.const_data_ptr(), static_cast<char*>(dst.mutable_data_ptr()) +
                                 offsets[0] * dst.element_size(), src.numel(), static_cast<float>(scale),
                                 apply_scale, stream));
    return;
  }
  std::vector<Region> regions;
  for (size_t i = 0; i < inputs.size(); ++i) regions.push_back({&inputs[i], offsets[i]});
  launch_by_dtype(regions, dst.device(), "pack", [&](int src_dtype, const int64_t* table, int count, int64_t max_numel) {
    check_launch(launch_pack_many(src_dtype, dst_dtype, reinterpret_cast<const long long*>(table), count, max_numel,
                                  dst.mutable_data_ptr(), static_cast<float>(scale), apply_scale, stream));
  });
}

void accumulate_cuda(const at::Tensor& dst, const at::Tensor& src, double scale, int64_t num_chunks) {
  check_accumulate(dst, src, num_chunks);
  const c10::cuda::CUDAGuard guard(dst.device());
  check_launch(launch_accumulate(static_cast<int>(flat_dtype(dst, "accumulate", "dst")),
                                 static_cast<int>(flat_dtype(src, "accumulate", "src")), dst.mutable_data_ptr(),
                                 src.const_data_ptr(), dst.numel(), static_cast<int>(num_chunks),
                                 static_cast<float>(scale), scale != 1.0, c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(overlap, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("accumulate", &accumulate_cuda);
}

}  // namespace overlap

#endif  // OVERLAP_WITH_CUDA
