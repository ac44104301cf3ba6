// Launch configuration for the kernels of kernels/flat_kernels.cu (included here, so the
// extension and the CuPy backend run the very same device code).
#include "flat_kernels.cu"
#include "flat_launch.h"

namespace overlap {
namespace {

constexpr int kThreads = 256;
constexpr long long kElementsPerBlock = (long long)kThreads * OVERLAP_VEC;
// Blocks of one launch beyond this stride over their tensor instead of adding more blocks.
constexpr long long kMaxBlocks = 1 << 16;

unsigned int blocks_for(long long numel, int tensors) {
  long long blocks = (numel + kElementsPerBlock - 1) / kElementsPerBlock;
  long long cap = kMaxBlocks / (tensors > 0 ? tensors : 1);
  if (blocks > cap) blocks = cap;
  return (unsigned int)(blocks > 0 ? blocks : 1);
}

#define OVERLAP_ROW(OP, SN) {OP##_##SN##_f32, OP##_##SN##_f16, OP##_##SN##_bf16}
#define OVERLAP_TABLE(OP) {OVERLAP_ROW(OP, f32), OVERLAP_ROW(OP, f16), OVERLAP_ROW(OP, bf16)}

// [source dtype][destination dtype]
void (*const kPackOne[3][3])(const void*, void*, long long, float, int) = OVERLAP_TABLE(pack_one);
void (*const kPackMany[3][3])(const long long*, int, void*, float, int) = OVERLAP_TABLE(pack_many);
void (*const kUnpackMany[3][3])(const void*, const long long*, int) = OVERLAP_TABLE(unpack_many);
// [source dtype][destination dtype], as the entry points are named
void (*const kAccumulate[3][3])(void*, const void*, long long, int, float, int) = OVERLAP_TABLE(accumulate);

}  // namespace

int launch_pack_one(int src_dtype, int dst_dtype, const void* src, void* dst, long long numel, float scale,
                    int apply_scale, void* stream) {
  if (numel == 0) return cudaSuccess;
  kPackOne[src_dtype][dst_dtype]<<<blocks_for(numel, 1), kThreads, 0, (cudaStream_t)stream>>>(
      src, dst, numel, scale, apply_scale);
  return cudaGetLastError();
}

int launch_pack_many(int src_dtype, int dst_dtype, const long long* table, int count, long long max_numel,
                     void* dst, float scale, int apply_scale, void* stream) {
  if (count == 0 || max_numel == 0) return cudaSuccess;
  dim3 grid(blocks_for(max_numel, count), count);
  kPackMany[src_dtype][dst_dtype]<<<grid, kThreads, 0, (cudaStream_t)stream>>>(table, count, dst, scale,
                                                                               apply_scale);
  return cudaGetLastError();
}

int launch_unpack_many(int src_dtype, int dst_dtype, const void* src, const long long* table, int count,
                       long long max_numel, void* stream) {
  if (count == 0 || max_numel == 0) return cudaSuccess;
  dim3 grid(blocks_for(max_numel, count), count);
  kUnpackMany[src_dtype][dst_dtype]<<<grid, kThreads, 0, (cudaStream_t)stream>>>(src, table, count);
  return cudaGetLastError();
}

int launch_accumulate(int dst_dtype, int src_dtype, void* dst, const void* src, long long numel, int chunks,
                      float scale, int apply_scale, void* stream) {
  if (numel == 0) return cudaSuccess;
  kAccumulate[src_dtype][dst_dtype]<<<blocks_for(numel, 1), kThreads, 0, (cudaStream_t)stream>>>(
      dst, src, numel, chunks, scale, apply_scale);
  return cudaGetLastError();
}

}  // namespace overlap
