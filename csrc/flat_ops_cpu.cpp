// CPU implementation of the `torch.ops.overlap` flat-buffer ops.
//
// Work is split into items of at most kGrain elements of one tensor, so a launch of one huge
// tensor and a launch of hundreds of tiny ones both spread over at::parallel_for's threads.
// Loops convert through float one element at a time in a form the compiler vectorises;
// the build passes -ffp-contract=off so `a + b * s` stays two roundings, as in torch.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_convert.h"
#include "flat_ops.h"

namespace overlap {
namespace {

constexpr int64_t kGrain = 1 << 16;
// Rows of the accumulate sum are added into a float scratch of this many elements.
constexpr int64_t kScratch = 512;

using CopyFn = void (*)(const void*, void*, int64_t, float, bool);
using AccumulateFn = void (*)(void*, const void*, int64_t, int64_t, int64_t, float, bool);

template <typename S, typename D>
OVERLAP_VECTORISED void copy_span(const void* src_v, void* dst_v, int64_t n, float scale, bool apply_scale) {
  auto src = static_cast<const typename S::word*>(src_v);
  auto dst = static_cast<typename D::word*>(dst_v);
  if constexpr (std::is_same_v<S, D>) {
    if (!apply_scale) {
      if (src != dst) std::memcpy(dst, src, n * sizeof(*dst));
      return;
    }
  }
  if (apply_scale) {
    for (int64_t i = 0; i < n; ++i) dst[i] = D::store(S::load(src[i]) * scale);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = D::store(S::load(src[i]));
  }
}

// dst[0:n] += cast(scale * sum of `chunks` rows of src); rows are `row` elements apart.
template <typename D, typename S>
OVERLAP_VECTORISED void accumulate_span(void* dst_v, const void* src_v, int64_t n, int64_t chunks, int64_t row, float scale,
                     bool apply_scale) {
  auto dst = static_cast<typename D::word*>(dst_v);
  auto src = static_cast<const typename S::word*>(src_v);
  float total[kScratch];
  for (int64_t lo = 0; lo < n; lo += kScratch) {
    const int64_t len = std::min(kScratch, n - lo);
    for (int64_t j = 0; j < len; ++j) total[j] = S::load(src[lo + j]);
    for (int64_t c = 1; c < chunks; ++c) {
      const typename S::word* chunk = src + c * row + lo;
      for (int64_t j = 0; j < len; ++j) total[j] += S::load(chunk[j]);
    }
    if (apply_scale) {
      for (int64_t j = 0; j < len; ++j) total[j] *= scale;
    }
    // A 16-bit dst rounds the sum to its dtype first, as `dst.add_(total.to(dst.dtype))` does.
    for (int64_t j = 0; j < len; ++j) dst[lo + j] = D::store(D::load(dst[lo + j]) + D::load(D::store(total[j])));
  }
}

template <typename S>
CopyFn copy_from(FlatDtype dst) {
  switch (dst) {
    case FlatDtype::kF32: return copy_span<S, F32>;
    case FlatDtype::kF16: return copy_span<S, F16>;
    default: return copy_span<S, BF16>;
  }
}

CopyFn copy_fn(FlatDtype src, FlatDtype dst) {
  switch (src) {
    case FlatDtype::kF32: return copy_from<F32>(dst);
    case FlatDtype::kF16: return copy_from<F16>(dst);
    default: return copy_from<BF16>(dst);
  }
}

template <typename D>
AccumulateFn accumulate_into(FlatDtype src) {
  switch (src) {
    case FlatDtype::kF32: return accumulate_span<D, F32>;
    case FlatDtype::kF16: return accumulate_span<D, F16>;
    default: return accumulate_span<D, BF16>;
  }
}

AccumulateFn accumulate_fn(FlatDtype dst, FlatDtype src) {
  switch (dst) {
    case FlatDtype::kF32: return accumulate_into<F32>(src);
    case FlatDtype::kF16: return accumulate_into<F16>(src);
    default: return accumulate_into<BF16>(src);
  }
}

// One copy per tensor: `numel` elements from `src` to `dst`, both contiguous.
struct CopyJob {
  const char* src;
  char* dst;
  int64_t numel;
  int64_t src_item;  // bytes per element
  int64_t dst_item;
  CopyFn fn;
};

// Run every job's copy, split into kGrain-element items spread over the thread pool. A
// thread's consecutive items of one job are contiguous memory and are moved in one call.
void run_jobs(const std::vector<CopyJob>& jobs, float scale, bool apply_scale) {
  std::vector<int64_t> first_item(jobs.size() + 1, 0);
  for (size_t t = 0; t < jobs.size(); ++t) {
    first_item[t + 1] = first_item[t] + (jobs[t].numel + kGrain - 1) / kGrain;
  }
  at::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    size_t t = std::upper_bound(first_item.begin(), first_item.end(), begin) - first_item.begin() - 1;
    for (int64_t item = begin; item < end; item = first_item[++t]) {
      const CopyJob& job = jobs[t];
      const int64_t lo = (item - first_item[t]) * kGrain;
      const int64_t hi = std::min(job.numel, (std::min(end, first_item[t + 1]) - first_item[t]) * kGrain);
      if (hi > lo) job.fn(job.src + lo * job.src_item, job.dst + lo * job.dst_item, hi - lo, scale, apply_scale);
    }
  });
}

void pack_cpu(at::TensorList srcs, const at::Tensor& dst, at::IntArrayRef offsets, double scale) {
  check_flat(dst, "pack", "dst");
  check_regions(srcs, offsets, dst, "pack");
  const FlatDtype dst_dtype = flat_dtype(dst, "pack", "dst");
  std::vector<at::Tensor> inputs;  // keeps contiguous copies of strided sources alive
  std::vector<CopyJob> jobs;
  for (size_t i = 0; i < srcs.size(); ++i) {
    inputs.push_back(srcs[i].contiguous());
    const at::Tensor& src = inputs.back();
    jobs.push_back({static_cast<const char*>(src.const_data_ptr()),
                    static_cast<char*>(dst.mutable_data_ptr()) + offsets[i] * dst.element_size(), src.numel(),
                    static_cast<int64_t>(src.element_size()), static_cast<int64_t>(dst.element_size()),
                    copy_fn(flat_dtype(src, "pack", "a source"), dst_dtype)});
  }
  run_jobs(jobs, static_cast<float>(scale), scale != 1.0);
}

void accumulate_cpu(const at::Tensor& dst, const at::Tensor& src, double scale, int64_t num_chunks) {
  check_accumulate(dst, src, num_chunks);
  const AccumulateFn fn = accumulate_fn(flat_dtype(dst, "accumulate", "dst"), flat_dtype(src, "accumulate", "src"));
  const int64_t n = dst.numel();
  auto dst_bytes = static_cast<char*>(dst.mutable_data_ptr());
  auto src_bytes = static_cast<const char*>(src.const_data_ptr());
  const bool apply_scale = scale != 1.0;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    fn(dst_bytes + begin * dst.element_size(), src_bytes + begin * src.element_size(), end - begin, num_chunks, n,
       static_cast<float>(scale), apply_scale);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(overlap, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("accumulate", &accumulate_cpu);
}

}  // namespace overlap
