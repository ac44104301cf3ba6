// Flat-buffer kernels shared by the `overlap._C` CUDA build (nvcc) and the CuPy backend (NVRTC).
//
// Plain CUDA C++ with no includes, so NVRTC compiles it without a CUDA toolkit's headers:
// fp16 and bf16 are carried as raw 16-bit words and converted with PTX `cvt` instructions
// (round to nearest even, as torch does). Needs sm_80 or newer (bf16 `cvt`).
//
// Semantics (the torch reference backend is the truth):
//   pack        dst[offset_t + i] = cast(src_t[i] * scale)              for every tensor t
//   unpack      dst_t[i] = cast(src[offset_t + i])                       for every tensor t
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

template <typename S, typename D>
__device__ void unpack_many(const typename S::word* src, const long long* table, int count) {
  const int t = blockIdx.y;
  typename D::word* dst = reinterpret_cast<typename D::word*>(table[t]);
  copy_span<S, D>(src + table[2 * count + t], dst, table[count + t], 1.0f, 0);
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
  extern "C" __global__ void unpack_many_##SN##_##DN(const void* src, const long long* table,           \
                                                      int count) {                                      \
    unpack_many<S, D>(static_cast<const S::word*>(src), table, count);                                  \
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
