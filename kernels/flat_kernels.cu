// Flat-buffer kernels shared by the `overlap._C` CUDA build (nvcc) and the CuPy backend (NVRTC).
//
// Plain CUDA C++ with no includes, so NVRTC compiles it without a CUDA toolkit's headers:
// fp16 and bf16 are carried as raw 16-bit words and converted with PTX `cvt` instructions
// (round to nearest even, as torch does). Needs sm_80 or newer (bf16 `cvt`).
//
// Semantics (the torch reference backend is the truth):
//   pack        dst[offset_t + i] = cast(src_t[i] * scale)              for every tensor t
//   accumulate  dst[i] = dst[i] + cast(scale * sum_c src[c * n + i])     chunks summed in order
// Multiplies and adds use __fmul_rn/__fadd_rn so the compiler cannot fuse them into an FMA,
// which would round differently from torch's separate ops.
//
// Multi-tensor launches read a table of int64 rows (on the device): [address_t ...],
// [numel_t ...], [offset_t ...], `count` entries each. blockIdx.y picks the tensor and
// blockIdx.x strides over its elements, so one launch moves tensors of any mix of sizes.
// Each thread moves VEC consecutive elements with one vector load/store when the tensor's
// both ends are aligned to VEC elements; otherwise, and for the tail, one element at a time.

#define OVERLAP_VEC 4

struct f32_t { typedef float word; };
struct f16_t { typedef unsigned short word; };
struct bf16_t { typedef unsigned short word; };

template <typename T> struct convert;

template <> struct convert<f32_t> {
  static __device__ __forceinline__ float load(float w) { return w; }
  static __device__ __forceinline__ float store(float x) { return x; }
};

template <> struct convert<f16_t> {
  static __device__ __forceinline__ float load(unsigned short w) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(w));
    return x;
  }
  static __device__ __forceinline__ unsigned short store(float x) {
    unsigned short w;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(w) : "f"(x));
    return w;
  }
};

template <> struct convert<bf16_t> {
  static __device__ __forceinline__ float load(unsigned short w) {
    return __uint_as_float(((unsigned int)w) << 16);
  }
  static __device__ __forceinline__ unsigned short store(float x) {
    unsigned short w;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(w) : "f"(x));
    return w;
  }
};

// VEC words of one dtype moved as a single aligned load or store (16 bytes for fp32, 8 for 16-bit).
template <typename W> struct vec_word;
template <> struct vec_word<float> { typedef float4 type; };
template <> struct vec_word<unsigned short> { typedef uint2 type; };

template <typename T>
__device__ __forceinline__ void load_vec(const typename T::word* p, float x[OVERLAP_VEC]) {
  typedef typename T::word W;
  union { typename vec_word<W>::type v; W w[OVERLAP_VEC]; } u;
  u.v = *reinterpret_cast<const typename vec_word<W>::type*>(p);
#pragma unroll
  for (int k = 0; k < OVERLAP_VEC; ++k) x[k] = convert<T>::load(u.w[k]);
}

template <typename T>
__device__ __forceinline__ void store_vec(typename T::word* p, const float x[OVERLAP_VEC]) {
  typedef typename T::word W;
  union { typename vec_word<W>::type v; W w[OVERLAP_VEC]; } u;
#pragma unroll
  for (int k = 0; k < OVERLAP_VEC; ++k) u.w[k] = convert<T>::store(x[k]);
  *reinterpret_cast<typename vec_word<W>::type*>(p) = u.v;
}

template <typename W>
__device__ __forceinline__ bool vec_aligned(const W* p) {
  return (reinterpret_cast<unsigned long long>(p) % (OVERLAP_VEC * sizeof(W))) == 0;
}

__device__ __forceinline__ float scaled(float x, float scale, int apply_scale) {
  return apply_scale ? __fmul_rn(x, scale) : x;
}

// Copy n elements src -> dst with cast and optional scale; the blocks of blockIdx.x share it.
template <typename S, typename D>
__device__ void copy_span(const typename S::word* src, typename D::word* dst, long long n, float scale,
                          int apply_scale) {
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long done = 0;
  if (vec_aligned(src) && vec_aligned(dst)) {
    const long long nvec = n / OVERLAP_VEC;
    for (long long v = thread; v < nvec; v += stride) {
      float x[OVERLAP_VEC];
      load_vec<S>(src + v * OVERLAP_VEC, x);
#pragma unroll
      for (int k = 0; k < OVERLAP_VEC; ++k) x[k] = scaled(x[k], scale, apply_scale);
      store_vec<D>(dst + v * OVERLAP_VEC, x);
    }
    done = nvec * OVERLAP_VEC;
  }
  for (long long i = done + thread; i < n; i += stride) {
    dst[i] = convert<D>::store(scaled(convert<S>::load(src[i]), scale, apply_scale));
  }
}

template <typename S, typename D>
__device__ void pack_many(const long long* table, int count, typename D::word* dst, float scale, int apply_scale) {
  const int t = blockIdx.y;
  const typename S::word* src = reinterpret_cast<const typename S::word*>(table[t]);
  copy_span<S, D>(src, dst + table[2 * count + t], table[count + t], scale, apply_scale);
}

// dst += cast(scale * sum of `chunks` rows of src); a 16-bit dst rounds the sum to its dtype
// first, then the addition, as `dst.add_(total.to(dst.dtype))` does.
template <typename D, typename S>
__device__ void accumulate_span(typename D::word* dst, const typename S::word* src, long long n, int chunks,
                                float scale, int apply_scale) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float total = convert<S>::load(src[i]);
    for (int c = 1; c < chunks; ++c) total = __fadd_rn(total, convert<S>::load(src[(long long)c * n + i]));
    total = scaled(total, scale, apply_scale);
    const float rounded = convert<D>::load(convert<D>::store(total));
    dst[i] = convert<D>::store(__fadd_rn(convert<D>::load(dst[i]), rounded));
  }
}

// Entry points: one per (source, destination) dtype pair, named <op>_<src>_<dst>. Buffers are
// untyped pointers so a host can keep all nine of an op in one table.
#define OVERLAP_DEFINE_PAIR(SN, S, DN, D)                                                                \
  extern "C" __global__ void pack_one_##SN##_##DN(const void* src, void* dst, long long n, float scale,  \
                                                   int apply_scale) {                                   \
    copy_span<S, D>(static_cast<const S::word*>(src), static_cast<D::word*>(dst), n, scale, apply_scale); \
  }                                                                                                     \
  extern "C" __global__ void pack_many_##SN##_##DN(const long long* table, int count, void* dst,        \
                                                    float scale, int apply_scale) {                     \
    pack_many<S, D>(table, count, static_cast<D::word*>(dst), scale, apply_scale);                      \
  }                                                                                                     \
  extern "C" __global__ void accumulate_##SN##_##DN(void* dst, const void* src, long long n, int chunks, \
                                                     float scale, int apply_scale) {                    \
    accumulate_span<D, S>(static_cast<D::word*>(dst), static_cast<const S::word*>(src), n, chunks, scale, \
                          apply_scale);                                                                 \
  }

#define OVERLAP_DEFINE_FROM(SN, S)       \
  OVERLAP_DEFINE_PAIR(SN, S, f32, f32_t) \
  OVERLAP_DEFINE_PAIR(SN, S, f16, f16_t) \
  OVERLAP_DEFINE_PAIR(SN, S, bf16, bf16_t)

OVERLAP_DEFINE_FROM(f32, f32_t)
OVERLAP_DEFINE_FROM(f16, f16_t)
OVERLAP_DEFINE_FROM(bf16, bf16_t)

// ---- Block-quantised communication (semantics and layout: kernels/quantized.py) ---------------
//
//   quantize               per block of x = src (+ error): scale = absmax / qmax, NaN if the block
//                          holds inf or NaN; q = round_half_even(clamp(x / scale)) where scale > 0,
//                          else 0; error = x - q * scale
//   dequantize_accumulate  dst[i] += (d_0[i] + d_1[i] + ...), d_c = chunk c's q * scale, fp32
//   dequantize_into        dst[i] = cast(q[i] * scale)
// qmax is 127 (bits 8: one int8 per element) or 7 (bits 4: element 2j in the low nibble of byte
// j, 2j + 1 in the high one). Blocks are even, so a byte never straddles two blocks, and every
// thread handles element pairs (2p, 2p + 1). Divisions are __fdiv_rn (IEEE, as torch's `/`).
//
// quantize: one warp per block, lanes striding over its pairs. The absmax is a warp max of the
// bit patterns with the sign cleared (integer order is float order for non-negative floats; inf
// and NaN are >= 0x7F800000). Each lane reads its pairs twice, once for the max and once to
// quantise; the second read hits the cache.

// 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to the nearest integer, ties to even
// (ROUNDING_MAGIC in kernels/quantized.py).
#define OVERLAP_ROUNDING_MAGIC 12582912.0f
#define OVERLAP_EXPONENT_BITS 0x7F800000u

__device__ __forceinline__ int quantize_value(float x, float scale, float qmax) {
  if (!(scale > 0.0f)) return 0;  // zeros, an underflowed scale, or a non-finite block (NaN)
  float y = __fdiv_rn(x, scale);
  y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
  return (int)__fsub_rn(__fadd_rn(y, OVERLAP_ROUNDING_MAGIC), OVERLAP_ROUNDING_MAGIC);
}

template <typename S>
__device__ __forceinline__ float quantize_input(const typename S::word* src, const float* error, long long i) {
  const float x = convert<S>::load(src[i]);
  return error ? __fadd_rn(x, error[i]) : x;
}

template <typename S, int BITS>
__device__ void quantize_blocks(const typename S::word* src, float* error, void* q, float* scales, long long n,
                                int block) {
  const float qmax = BITS == 8 ? 127.0f : 7.0f;
  const int lane = threadIdx.x & 31;
  const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
  const long long nb = (n + block - 1) / block;
  for (long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nb; b += warps) {
    const long long lo = b * block;
    const long long len = n - lo < block ? n - lo : block;
    unsigned int absmax_bits = 0;
    for (long long i = 2 * lane; i < len; i += 64) {
      const unsigned int b0 = __float_as_uint(quantize_input<S>(src, error, lo + i)) & 0x7FFFFFFFu;
      const unsigned int b1 = i + 1 < len ? __float_as_uint(quantize_input<S>(src, error, lo + i + 1)) & 0x7FFFFFFFu : 0u;
      absmax_bits = b0 > absmax_bits ? b0 : absmax_bits;
      absmax_bits = b1 > absmax_bits ? b1 : absmax_bits;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const unsigned int other = __shfl_xor_sync(0xFFFFFFFFu, absmax_bits, offset);
      absmax_bits = other > absmax_bits ? other : absmax_bits;
    }
    const float scale = absmax_bits >= OVERLAP_EXPONENT_BITS ? __uint_as_float(0x7FC00000u)
                                                              : __fdiv_rn(__uint_as_float(absmax_bits), qmax);
    if (lane == 0) scales[b] = scale;
    for (long long i = 2 * lane; i < len; i += 64) {
      const bool pair = i + 1 < len;
      const float x0 = quantize_input<S>(src, error, lo + i);
      const float x1 = pair ? quantize_input<S>(src, error, lo + i + 1) : 0.0f;
      const int q0 = quantize_value(x0, scale, qmax);
      const int q1 = quantize_value(x1, scale, qmax);
      if (error) {
        error[lo + i] = __fsub_rn(x0, __fmul_rn((float)q0, scale));
        if (pair) error[lo + i + 1] = __fsub_rn(x1, __fmul_rn((float)q1, scale));
      }
      if (BITS == 8) {
        signed char* out = static_cast<signed char*>(q) + lo + i;
        out[0] = (signed char)q0;
        if (pair) out[1] = (signed char)q1;
      } else {
        static_cast<unsigned char*>(q)[(lo + i) / 2] = (unsigned char)((q0 & 0xF) | ((q1 & 0xF) << 4));
      }
    }
  }
}

// Elements 2p and 2p + 1 of one chunk's q, as floats (4 bits: nibbles sign-extended).
template <int BITS>
__device__ __forceinline__ void decode_pair(const void* q, long long p, bool pair, float& v0, float& v1) {
  if (BITS == 8) {
    const signed char* values = static_cast<const signed char*>(q) + 2 * p;
    v0 = (float)values[0];
    v1 = pair ? (float)values[1] : 0.0f;
  } else {
    const unsigned int byte = static_cast<const unsigned char*>(q)[p];
    v0 = (float)((int)(byte << 28) >> 28);
    v1 = (float)((int)(byte << 24) >> 28);
  }
}

// One thread per element pair. ACCUMULATE: fp32 dst += the chunks' sum (-0.0 is the exact identity
// of `+`); otherwise dst = cast(q * scale) of the single chunk.
template <typename D, int BITS, bool ACCUMULATE>
__device__ void dequantize_pairs(typename D::word* dst, const void* q, const float* scales, long long n, int block,
                                 int chunks) {
  const long long pairs = (n + 1) / 2;
  const long long chunk_bytes = BITS == 8 ? n : pairs;
  const long long nb = (n + block - 1) / block;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += stride) {
    const bool pair = 2 * p + 1 < n;
    const long long b = 2 * p / block;
    float total0 = -0.0f, total1 = -0.0f;
    for (int c = 0; c < chunks; ++c) {
      float v0, v1;
      decode_pair<BITS>(static_cast<const char*>(q) + c * chunk_bytes, p, pair, v0, v1);
      const float scale = scales[c * nb + b];
      total0 = __fadd_rn(total0, __fmul_rn(v0, scale));
      total1 = __fadd_rn(total1, __fmul_rn(v1, scale));
    }
    if (ACCUMULATE) {
      dst[2 * p] = convert<D>::store(__fadd_rn(convert<D>::load(dst[2 * p]), total0));
      if (pair) dst[2 * p + 1] = convert<D>::store(__fadd_rn(convert<D>::load(dst[2 * p + 1]), total1));
    } else {
      dst[2 * p] = convert<D>::store(total0);
      if (pair) dst[2 * p + 1] = convert<D>::store(total1);
    }
  }
}

// Entry points: quantize_<src>_b<bits>, dequantize_into_<dst>_b<bits>, dequantize_accumulate_b<bits>.
// `error` may be null (no error feedback).
#define OVERLAP_DEFINE_QUANT(BITS)                                                                       \
  extern "C" __global__ void dequantize_accumulate_b##BITS(float* dst, const void* q, const float* scales, \
                                                            long long n, int block, int chunks) {          \
    dequantize_pairs<f32_t, BITS, true>(dst, q, scales, n, block, chunks);                               \
  }

#define OVERLAP_DEFINE_QUANT_DTYPE(TN, T, BITS)                                                           \
  extern "C" __global__ void quantize_##TN##_b##BITS(const void* src, float* error, void* q, float* scales, \
                                                      long long n, int block) {                           \
    quantize_blocks<T, BITS>(static_cast<const T::word*>(src), error, q, scales, n, block);              \
  }                                                                                                       \
  extern "C" __global__ void dequantize_into_##TN##_b##BITS(void* dst, const void* q, const float* scales, \
                                                             long long n, int block) {                    \
    dequantize_pairs<T, BITS, false>(static_cast<T::word*>(dst), q, scales, n, block, 1);                 \
  }

#define OVERLAP_DEFINE_QUANT_BITS(BITS)        \
  OVERLAP_DEFINE_QUANT(BITS)                   \
  OVERLAP_DEFINE_QUANT_DTYPE(f32, f32_t, BITS) \
  OVERLAP_DEFINE_QUANT_DTYPE(f16, f16_t, BITS) \
  OVERLAP_DEFINE_QUANT_DTYPE(bf16, bf16_t, BITS)

OVERLAP_DEFINE_QUANT_BITS(8)
OVERLAP_DEFINE_QUANT_BITS(4)
