// CPU implementation of the quantised ops (semantics and layout: kernels/quantized.py).
//
// Work is split over quantisation blocks, at least kQuantGrain elements' worth per task. Every loop
// is a plain loop over one block's contiguous elements that the compiler vectorises (built per
// CPU level, see cpu_convert.h); dequantising decodes a block into float stack buffers.
// The absmax is an integer max over the bit patterns with the sign cleared: for non-negative
// floats the integer order is the float order, and inf and NaN (all exponent bits set) come
// out at or above 0x7F800000, which is how a non-finite block is recognised.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu_convert.h"
#include "quant_ops.h"

namespace overlap {
namespace {

constexpr int64_t kQuantGrain = 1 << 16;
// ROUNDING_MAGIC in kernels/quantized.py: (y + M) - M rounds |y| < 2**22 to nearest even.
constexpr float kRoundingMagic = 12582912.0f;
constexpr uint32_t kExponentBits = 0x7F800000u;

template <int BITS>
constexpr float qmax() { return BITS == 8 ? 127.0f : 7.0f; }

// Helpers of the OVERLAP_VECTORISED loops are always inlined into them: one left out of line is
// compiled for the baseline CPU only (measured 3x slower for the 4-bit quantize).
#if defined(__GNUC__)
#define OVERLAP_INLINE inline __attribute__((always_inline))
#else
#define OVERLAP_INLINE inline
#endif

// The first `len` elements of a block, starting at element `lo` of one chunk's q, as floats.
// 4 bits: element 2j is byte j's low nibble; sign-extended by arithmetic shifts. Writes
// len rounded up to even entries of `out`.
template <int BITS>
OVERLAP_INLINE void decode(const void* q, int64_t lo, int64_t len, float* out) {
  if constexpr (BITS == 8) {
    const int8_t* values = static_cast<const int8_t*>(q) + lo;
    for (int64_t j = 0; j < len; ++j) out[j] = static_cast<float>(values[j]);
  } else {
    const uint8_t* bytes = static_cast<const uint8_t*>(q) + lo / 2;
    for (int64_t p = 0; p < (len + 1) / 2; ++p) {
      const uint8_t byte = bytes[p];
      out[2 * p] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(byte << 4)) >> 4);
      out[2 * p + 1] = static_cast<float>(static_cast<int8_t>(byte) >> 4);
    }
  }
}

// round_half_even(clamp(x / scale, -qmax, qmax)), for scale > 0 and finite x. Rounding first
// and clamping the integer gives the same value and vectorises where a float clamp does not;
// |x / scale| stays far below 2**22 (it exceeds qmax only by rounding, or for a subnormal scale).
template <int BITS>
OVERLAP_INLINE int8_t quantize_value(float x, float scale) {
  constexpr int32_t kMax = static_cast<int32_t>(qmax<BITS>());
  const int32_t rounded = static_cast<int32_t>((x / scale + kRoundingMagic) - kRoundingMagic);
  return static_cast<int8_t>(std::min(std::max(rounded, -kMax), kMax));
}

// One block of `len` elements: x = src (+ error), computed again in each pass instead of kept
// in a buffer (storing to a stack buffer while loading the source measured up to 2x slower at
// some block sizes). Writes the block's scale, its q from `q_out` on (8 bits: int8 per element;
// 4 bits: packed bytes), and with FEEDBACK its error.
template <typename S, int BITS, bool FEEDBACK>
OVERLAP_INLINE void quantize_block(const typename S::word* src, float* error, int64_t len, void* q_out, float* scale_out) {
  auto x = [&](int64_t j) {
    if constexpr (FEEDBACK) {
      return S::load(src[j]) + error[j];
    } else {
      return S::load(src[j]);
    }
  };
  uint32_t absmax_bits = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float value = x(j);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    absmax_bits = std::max(absmax_bits, bits & 0x7FFFFFFFu);
  }
  float scale = std::numeric_limits<float>::quiet_NaN();
  if (absmax_bits < kExponentBits) {
    float absmax;
    std::memcpy(&absmax, &absmax_bits, sizeof(absmax));
    scale = absmax / qmax<BITS>();
  }
  *scale_out = scale;
  // 8 bits: q straight into the output; 4 bits: into a stack buffer, then two per byte.
  int8_t unpacked[kMaxQuantBlock + 1];
  int8_t* q = BITS == 8 ? static_cast<int8_t*>(q_out) : unpacked;
  if (scale > 0.0f) {
    for (int64_t j = 0; j < len; ++j) q[j] = quantize_value<BITS>(x(j), scale);
  } else {  // zeros (or a scale that underflowed), or a non-finite block: q = 0
    std::fill(q, q + len, int8_t{0});
  }
  if constexpr (FEEDBACK) {  // a loop of its own: fused into the one above it is not vectorised
    for (int64_t j = 0; j < len; ++j) error[j] = x(j) - static_cast<float>(q[j]) * scale;
  }
  if constexpr (BITS == 4) {
    unpacked[len] = 0;  // an odd last block leaves its last high nibble 0
    // Each pair read as one little-endian uint16 (element 2p in its low byte): a contiguous
    // loop, which vectorises where byte-strided reads did not (3x faster).
    uint8_t* out = static_cast<uint8_t*>(q_out);
    for (int64_t p = 0; p < (len + 1) / 2; ++p) {
      uint16_t pair;
      std::memcpy(&pair, unpacked + 2 * p, sizeof(pair));
      out[p] = static_cast<uint8_t>((pair & 0x0Fu) | ((pair >> 4) & 0xF0u));
    }
  }
}

template <typename S, int BITS>
OVERLAP_VECTORISED void quantize_blocks(const void* src_v, float* error, void* q_v, float* scales, int64_t n,
                                        int64_t block, int64_t first, int64_t last) {
  const auto* src = static_cast<const typename S::word*>(src_v);
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t len = std::min(block, n - lo);
    void* q_out = static_cast<char*>(q_v) + (BITS == 8 ? lo : lo / 2);
    if (error != nullptr) {
      quantize_block<S, BITS, true>(src + lo, error + lo, len, q_out, scales + b);
    } else {
      quantize_block<S, BITS, false>(src + lo, nullptr, len, q_out, scales + b);
    }
  }
}

// dst += total, total = d_0 + d_1 + ... in chunk order; -0.0 is the exact identity of `+`.
template <int BITS>
OVERLAP_VECTORISED void dequantize_accumulate_blocks(float* dst, const void* q, const float* scales, int64_t n,
                                                     int64_t block, int64_t chunks, int64_t first, int64_t last) {
  const int64_t chunk_bytes = quant_bytes(n, BITS);
  const int64_t nb = quant_blocks(n, block);
  float values[kMaxQuantBlock];
  float total[kMaxQuantBlock];
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t len = std::min(block, n - lo);
    for (int64_t j = 0; j < len; ++j) total[j] = -0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      decode<BITS>(static_cast<const char*>(q) + c * chunk_bytes, lo, len, values);
      const float scale = scales[c * nb + b];
      for (int64_t j = 0; j < len; ++j) total[j] = total[j] + values[j] * scale;
    }
    for (int64_t j = 0; j < len; ++j) dst[lo + j] = dst[lo + j] + total[j];
  }
}

template <typename D, int BITS>
OVERLAP_VECTORISED void dequantize_into_blocks(void* dst_v, const void* q, const float* scales, int64_t n,
                                               int64_t block, int64_t first, int64_t last) {
  auto* dst = static_cast<typename D::word*>(dst_v);
  float values[kMaxQuantBlock];
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t len = std::min(block, n - lo);
    decode<BITS>(q, lo, len, values);
    const float scale = scales[b];
    for (int64_t j = 0; j < len; ++j) dst[lo + j] = D::store(values[j] * scale);
  }
}

using QuantizeFn = void (*)(const void*, float*, void*, float*, int64_t, int64_t, int64_t, int64_t);
using IntoFn = void (*)(void*, const void*, const float*, int64_t, int64_t, int64_t, int64_t);

// [dtype (FlatDtype)][bits == 4]
const QuantizeFn kQuantize[3][2] = {{quantize_blocks<F32, 8>, quantize_blocks<F32, 4>},
                                    {quantize_blocks<F16, 8>, quantize_blocks<F16, 4>},
                                    {quantize_blocks<BF16, 8>, quantize_blocks<BF16, 4>}};
const IntoFn kDequantizeInto[3][2] = {{dequantize_into_blocks<F32, 8>, dequantize_into_blocks<F32, 4>},
                                      {dequantize_into_blocks<F16, 8>, dequantize_into_blocks<F16, 4>},
                                      {dequantize_into_blocks<BF16, 8>, dequantize_into_blocks<BF16, 4>}};

// Calls fn(first_block, last_block) over the blocks of n elements, in parallel.
template <typename Fn>
void for_blocks(int64_t n, int64_t block, const Fn& fn) {
  at::parallel_for(0, quant_blocks(n, block), std::max<int64_t>(1, kQuantGrain / block), fn);
}

void quantize_cpu(const at::Tensor& src, const at::Tensor& q, const at::Tensor& scales,
                  const std::optional<at::Tensor>& error, int64_t block, int64_t bits) {
  check_quantize(src, q, scales, error, block, bits);
  const QuantizeFn fn = kQuantize[static_cast<int>(flat_dtype(src, "quantize", "src"))][bits == 4];
  const void* src_data = src.const_data_ptr();
  float* error_data = error.has_value() ? error->mutable_data_ptr<float>() : nullptr;
  void* q_data = q.mutable_data_ptr();
  float* scales_data = scales.mutable_data_ptr<float>();
  const int64_t n = src.numel();
  for_blocks(n, block, [&](int64_t first, int64_t last) {
    fn(src_data, error_data, q_data, scales_data, n, block, first, last);
  });
}

void dequantize_accumulate_cpu(const at::Tensor& dst, const at::Tensor& q, const at::Tensor& scales, int64_t block,
                               int64_t bits, int64_t chunks) {
  check_dequantize("dequantize_accumulate", dst, q, scales, block, bits, chunks, /*accumulate=*/true);
  float* dst_data = dst.mutable_data_ptr<float>();
  const void* q_data = q.const_data_ptr();
  const float* scales_data = scales.const_data_ptr<float>();
  const int64_t n = dst.numel();
  for_blocks(n, block, [&](int64_t first, int64_t last) {
    (bits == 8 ? dequantize_accumulate_blocks<8> : dequantize_accumulate_blocks<4>)(
        dst_data, q_data, scales_data, n, block, chunks, first, last);
  });
}

void dequantize_into_cpu(const at::Tensor& dst, const at::Tensor& q, const at::Tensor& scales, int64_t block,
                         int64_t bits) {
  check_dequantize("dequantize_into", dst, q, scales, block, bits, 1, /*accumulate=*/false);
  const IntoFn fn = kDequantizeInto[static_cast<int>(flat_dtype(dst, "dequantize_into", "dst"))][bits == 4];
  void* dst_data = dst.mutable_data_ptr();
  const void* q_data = q.const_data_ptr();
  const float* scales_data = scales.const_data_ptr<float>();
  const int64_t n = dst.numel();
  for_blocks(n, block, [&](int64_t first, int64_t last) { fn(dst_data, q_data, scales_data, n, block, first, last); });
}

}  // namespace

TORCH_LIBRARY_IMPL(overlap, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize_accumulate", &dequantize_accumulate_cpu);
  m.impl("dequantize_into", &dequantize_into_cpu);
}

}  // namespace overlap
