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
// [source dtype][destination dtype], as the entry points are named
void (*const kAccumulate[3][3])(void*, const void*, long long, int, float, int) = OVERLAP_TABLE(accumulate);

// Quantised ops: [dtype][bits == 4]
#define OVERLAP_QUANT_ROW(OP, TN) {OP##_##TN##_b8, OP##_##TN##_b4}
void (*const kQuantize[3][2])(const void*, float*, void*, float*, long long, int) = {
    OVERLAP_QUANT_ROW(quantize, f32), OVERLAP_QUANT_ROW(quantize, f16), OVERLAP_QUANT_ROW(quantize, bf16)};
void (*const kDequantizeInto[3][2])(void*, const void*, const float*, long long, int) = {
    OVERLAP_QUANT_ROW(dequantize_into, f32), OVERLAP_QUANT_ROW(dequantize_into, f16),
    OVERLAP_QUANT_ROW(dequantize_into, bf16)};
void (*const kDequantizeAccumulate[2])(float*, const void*, const float*, long long, int, int) = {
    dequantize_accumulate_b8, dequantize_accumulate_b4};

// quantize runs one warp per quantisation block; the dequantize kernels one thread per element pair.
unsigned int blocks_for_quantize(long long numel, int block) {
  const long long warps = (numel + block - 1) / block;
  const long long blocks = (warps + kThreads / 32 - 1) / (kThreads / 32);
  return (unsigned int)(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

unsigned int blocks_for_pairs(long long numel) {
  const long long blocks = ((numel + 1) / 2 + kThreads - 1) / kThreads;
  return (unsigned int)(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

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

int launch_accumulate(int dst_dtype, int src_dtype, void* dst, const void* src, long long numel, int chunks,
                      float scale, int apply_scale, void* stream) {
  if (numel == 0) return cudaSuccess;
  kAccumulate[src_dtype][dst_dtype]<<<blocks_for(numel, 1), kThreads, 0, (cudaStream_t)stream>>>(
      dst, src, numel, chunks, scale, apply_scale);
  return cudaGetLastError();
}

int launch_quantize(int src_dtype, int bits, const void* src, float* error, void* q, float* scales, long long numel,
                    int block, void* stream) {
  if (numel == 0) return cudaSuccess;
  kQuantize[src_dtype][bits == 4]<<<blocks_for_quantize(numel, block), kThreads, 0, (cudaStream_t)stream>>>(
      src, error, q, scales, numel, block);
  return cudaGetLastError();
}

int launch_dequantize_accumulate(int bits, float* dst, const void* q, const float* scales, long long numel, int block,
                                 int chunks, void* stream) {
  if (numel == 0) return cudaSuccess;
  kDequantizeAccumulate[bits == 4]<<<blocks_for_pairs(numel), kThreads, 0, (cudaStream_t)stream>>>(
      dst, q, scales, numel, block, chunks);
  return cudaGetLastError();
}

int launch_dequantize_into(int dst_dtype, int bits, void* dst, const void* q, const float* scales, long long numel,
                           int block, void* stream) {
  if (numel == 0) return cudaSuccess;
  kDequantizeInto[dst_dtype][bits == 4]<<<blocks_for_pairs(numel), kThreads, 0, (cudaStream_t)stream>>>(
      dst, q, scales, numel, block);
  return cudaGetLastError();
}

}  // namespace overlap
