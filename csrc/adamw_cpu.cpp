// CPU implementation of `torch.ops.overlap.adamw_step`: one AdamW step over flat fp32 buffers
// (semantics and the scalars: overlap/optim/reference.py and overlap/optim/scalars.py).
//
// One pass per element: read param, grad, exp_avg and exp_avg_sq, write param, exp_avg and
// exp_avg_sq, with a 16-bit gradient widened to fp32 in registers. torch's single-tensor
// AdamW makes six passes over these buffers and a temporary for the denominator.
//
// Every operation rounds as torch's kernel for it does, in torch's order (see [Note: the
// moment's lerp]), but the square root: IEEE here, where torch's vectorised one is one ulp off
// on a fraction of a percent of elements. The moments are torch.optim.AdamW's bit for bit, the
// parameters within a few ulps. The build passes -ffp-contract=off, so only the std::fma
// written here fuses. The caller computes the step's scalars in double precision
// exactly as torch.optim does in Python; they are rounded to float here, as ATen rounds a
// Python scalar for a float tensor. One of torch's two divisions, the one by the constant
// sqrt(1 - beta2^step), is computed through its reciprocal with a correction that gives the
// quotient's exact bits: the divide unit, which the square root and both divisions share, is
// close to memory as this loop's limit (see [Note: the division by bias2_sqrt]).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "cpu_convert.h"
#include "flat_ops.h"

namespace overlap {
namespace {

// Elements per parallel_for item: large enough that splitting costs nothing next to the work
// (about 20 µs of update per item), small enough that a 1M-element bucket uses both threads.
constexpr int64_t kAdamWGrain = 1 << 15;

struct AdamWScalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_coeff;     // see [Note: the moment's lerp]
  bool lerp_from_old;   // |1 - beta1| < 0.5
  float beta2;
  float one_minus_beta2;
  float bias2_sqrt;     // sqrt(1 - beta2^step)
  float inv_bias2_sqrt; // 1 / bias2_sqrt rounded to float, or 0: divide (see adamw_typed)
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  float grad_sign;      // -1 with maximize; multiplying by it is exact
};

// [Note: the moment's lerp]
// torch updates exp_avg with `exp_avg.lerp_(grad, 1 - beta1)`. ATen's vectorised CPU lerp (the
// path every buffer longer than one vector takes) computes fma(w, end - self, self) when
// |w| < 0.5 and fma(w - 1, end - self, end) otherwise, one rounding each; the same is done
// here, with w - 1 rounded in float as ATen does. Its addcmul (the second moment) is one fma as
// well; its addcdiv and division by a scalar are not.
//
// [Note: the division by bias2_sqrt]
// A step takes a square root and two divisions per element, and an x86 core has one divide
// unit for all three. With its data in L2 the AVX-512 loop took 0.42 ns per element on the
// development machine (an AVX-512 EPYC) with both divisions and 0.34 ns as it is now, the pace
// of DeepSpeedCPUAdam's loop (0.32 ns; it multiplies by reciprocals, which rounds differently),
// while a step from memory took 0.65 ns per element or more there: close enough that, with both
// divisions, DeepSpeedCPUAdam stepped 1-9% faster (docs/optim.md). The division of sqrt(v) by
// bias2_sqrt is by a constant, so it is done with r = 1 / bias2_sqrt
// (rounded to float): q = sqrt(v) * r, then q + (sqrt(v) - q * bias2_sqrt) * r, the residual
// exact by fma. By Markstein's theorem (r within half an ulp of 1 / bias2_sqrt, q within one ulp
// of the quotient) the corrected q is the correctly rounded quotient, the division's own bits,
// wherever the residual neither underflows nor overflows: checked for every non-negative float
// x on 456 divisors in [2^-27, 1], it differs from x / bias2_sqrt only for x below 2^-102 or
// above 2^103. A square root of a float is 0, NaN, inf or in [2^-75, 2^64], and
// bias2_sqrt = sqrt(1 - beta2^step) is in [2^-27, 1] for every beta2 in [0, 1); other values of
// it (the op takes any scalars) and CPUs without an fma instruction take the division. A q that
// is 0, infinite or NaN is the quotient already and is kept as it is (the correction would turn
// inf into NaN, and -0 into +0).
template <typename G, bool kFromOld, bool kByReciprocal>
inline void adamw_element(float* param, const typename G::word* grad, float* exp_avg, float* exp_avg_sq, int64_t i,
                          const AdamWScalars& s) {
  const float g = G::load(grad[i]) * s.grad_sign;
  const float m_old = exp_avg[i];
  const float m = std::fma(s.lerp_coeff, g - m_old, kFromOld ? m_old : g);
  // exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2); ATen's addcmul fuses the last
  // multiply and the add: fma((1 - b2) * g, g, v * b2).
  const float v = std::fma(s.one_minus_beta2 * g, g, exp_avg_sq[i] * s.beta2);
  // (exp_avg_sq.sqrt() / bias2_sqrt).add_(eps)
  const float root = std::sqrt(v);
  float scaled;
  if constexpr (kByReciprocal) {
    const float q = root * s.inv_bias2_sqrt;
    const float corrected = std::fma(std::fma(-q, s.bias2_sqrt, root), s.inv_bias2_sqrt, q);
    scaled = q != 0.0f && std::abs(q) < std::numeric_limits<float>::infinity() ? corrected : q;
  } else {
    scaled = root / s.bias2_sqrt;
  }
  const float denom = scaled + s.eps;
  // param.mul_(decay), then param.addcdiv_(exp_avg, denom, value=-step_size)
  param[i] = param[i] * s.decay + s.neg_step_size * m / denom;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
}

// The hot loop, one instantiation per lerp form so that no select is left in it.
template <typename G, bool kFromOld>
OVERLAP_VECTORISED void adamw_span(float* param, const typename G::word* grad, float* exp_avg, float* exp_avg_sq,
                                   int64_t n, AdamWScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    adamw_element<G, kFromOld, true>(param, grad, exp_avg, exp_avg_sq, i, s);
  }
}

// The same step with both divisions, for the scalars and CPUs the reciprocal does not cover.
template <typename G>
void adamw_span_dividing(float* param, const typename G::word* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                         AdamWScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    if (s.lerp_from_old) {
      adamw_element<G, true, false>(param, grad, exp_avg, exp_avg_sq, i, s);
    } else {
      adamw_element<G, false, false>(param, grad, exp_avg, exp_avg_sq, i, s);
    }
  }
}

// Whether std::fma compiles to an instruction on this CPU (in the clone that runs); without one
// it is a library call, and the reciprocal's two extra fma would cost more than the division.
bool fma_is_an_instruction() {
#if defined(__x86_64__) || defined(__i386__)
#if defined(__FMA__)
  return true;
#elif defined(__GNUC__) && !defined(__clang__)
  static const bool has_fma = __builtin_cpu_supports("fma");
  return has_fma;
#else
  return false;
#endif
#else
  return true;
#endif
}

using AdamWFn = void (*)(float*, const void*, float*, float*, int64_t, AdamWScalars);

template <typename G>
void adamw_typed(float* param, const void* grad, float* exp_avg, float* exp_avg_sq, int64_t n, AdamWScalars s) {
  const auto* g = static_cast<const typename G::word*>(grad);
  if (s.inv_bias2_sqrt == 0.0f) {
    adamw_span_dividing<G>(param, g, exp_avg, exp_avg_sq, n, s);
  } else if (s.lerp_from_old) {
    adamw_span<G, true>(param, g, exp_avg, exp_avg_sq, n, s);
  } else {
    adamw_span<G, false>(param, g, exp_avg, exp_avg_sq, n, s);
  }
}

void check_state(const at::Tensor& t, const at::Tensor& param, const char* what) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), "overlap::adamw_step: ", what,
                    " must be a contiguous 1-D tensor, got shape ", t.sizes(), " with strides ", t.strides());
  TORCH_CHECK_VALUE(t.numel() == param.numel(), "overlap::adamw_step: ", what, " has ", t.numel(),
                    " elements but param has ", param.numel());
  TORCH_CHECK_VALUE(t.device() == param.device(), "overlap::adamw_step: ", what, " is on ", t.device(),
                    " but param is on ", param.device());
}

void adamw_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, double decay, double beta1_weight, double beta2,
                    double one_minus_beta2, double bias2_sqrt, double eps, double neg_step_size, bool maximize) {
  check_state(param, param, "param");
  check_state(grad, param, "grad");
  check_state(exp_avg, param, "exp_avg");
  check_state(exp_avg_sq, param, "exp_avg_sq");
  for (const at::Tensor* t : {&param, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "overlap::adamw_step: param, exp_avg and exp_avg_sq must be "
                     "float32, got ", t->scalar_type());
  }
  AdamWFn fn;
  switch (flat_dtype(grad, "adamw_step", "grad")) {
    case FlatDtype::kF32: fn = adamw_typed<F32>; break;
    case FlatDtype::kF16: fn = adamw_typed<F16>; break;
    default: fn = adamw_typed<BF16>; break;
  }
  const float weight = static_cast<float>(beta1_weight);
  const bool from_old = std::abs(weight) < 0.5f;
  // The reciprocal where [Note: the division by bias2_sqrt] shows it exact; 0 selects the division.
  const float b2 = static_cast<float>(bias2_sqrt);
  const float inv_b2 = b2 >= 0x1p-27f && b2 <= 1.0f && fma_is_an_instruction() ? 1.0f / b2 : 0.0f;
  const AdamWScalars s{static_cast<float>(decay), from_old ? weight : weight - 1.0f, from_old,
                       static_cast<float>(beta2), static_cast<float>(one_minus_beta2), b2, inv_b2,
                       static_cast<float>(eps), static_cast<float>(neg_step_size), maximize ? -1.0f : 1.0f};
  float* p = param.mutable_data_ptr<float>();
  float* m = exp_avg.mutable_data_ptr<float>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  auto g = static_cast<const char*>(grad.const_data_ptr());
  const int64_t g_item = grad.element_size();
  at::parallel_for(0, param.numel(), kAdamWGrain, [&](int64_t begin, int64_t end) {
    fn(p + begin, g + begin * g_item, m + begin, v + begin, end - begin, s);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(overlap, CPU, m) { m.impl("adamw_step", &adamw_step_cpu); }

}  // namespace overlap
