// Element conversions through float for the CPU kernels (flat_ops_cpu.cpp, quant_ops_cpu.cpp),
// rounding as torch does, and the attribute that compiles their hot loops per CPU level.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace overlap {

// The hot loops are compiled for AVX-512, AVX2 (with F16C) and the baseline, and the best
// the CPU supports is picked when the library loads, as torch does for its own kernels.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OVERLAP_VECTORISED __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OVERLAP_VECTORISED
#endif

struct F32 {
  using word = float;
  static float load(float w) { return w; }
  static float store(float x) { return x; }
};

struct F16 {
  using word = uint16_t;
  static float load(uint16_t w) { return c10::detail::fp16_ieee_to_fp32_value(w); }
  static uint16_t store(float x) { return c10::detail::fp16_ieee_from_fp32_value(x); }
};

struct BF16 {
  using word = uint16_t;
  static float load(uint16_t w) {
    uint32_t bits = static_cast<uint32_t>(w) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  }
  // Round to nearest even; NaN becomes the canonical quiet NaN, as c10::BFloat16 does.
  static uint16_t store(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    uint32_t rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
    return x != x ? uint16_t(0x7FC0) : static_cast<uint16_t>(rounded);
  }
};

}  // namespace overlap
