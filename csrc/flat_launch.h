// Host-side launchers of the kernels in kernels/flat_kernels.cu, for flat_ops_cuda.cpp.
// Dtypes are FlatDtype codes (flat_ops.h); `stream` is a cudaStream_t; each returns the
// cudaError_t of its launch as an int. Tables are device int64 rows as flat_kernels.cu describes.
#pragma once

namespace overlap {

int launch_pack_one(int src_dtype, int dst_dtype, const void* src, void* dst, long long numel, float scale,
                    int apply_scale, void* stream);
int launch_pack_many(int src_dtype, int dst_dtype, const long long* table, int count, long long max_numel,
                     void* dst, float scale, int apply_scale, void* stream);
int launch_accumulate(int dst_dtype, int src_dtype, void* dst, const void* src, long long numel, int chunks,
                      float scale, int apply_scale, void* stream);
// Quantised ops (kernels/quantized.py); `error` may be null, `bits` is 8 or 4, dtypes as above.
int launch_quantize(int src_dtype, int bits, const void* src, float* error, void* q, float* scales, long long numel,
                    int block, void* stream);
int launch_dequantize_accumulate(int bits, float* dst, const void* q, const float* scales, long long numel, int block,
                                 int chunks, void* stream);
int launch_dequantize_into(int dst_dtype, int bits, void* dst, const void* q, const float* scales, long long numel,
                           int block, void* stream);

}  // namespace overlap
