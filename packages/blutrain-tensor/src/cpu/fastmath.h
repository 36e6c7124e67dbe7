// cpu/fastmath.h: float32 exp and tanh that compilers vectorise (std::expf/tanhf calls do not),
// Cephes' polynomials (relative error about 1e-7, within float32 rounding of the true value).
// Used for float32/float16/bfloat16 math; float64 keeps std::exp/std::tanh.
#pragma once

#include <cstdint>
#include <cstring>

// BT_CPU_CLONES: compile a hot loop three times (x86-64-v4 = AVX-512, v3 = AVX2 + FMA, and the
// baseline) and pick one at load time by the CPU's features (GCC's target_clones, an ifunc), so
// one wheel runs everywhere yet uses the wide vectors where they exist: float32 exp 4.7x faster
// with AVX-512 than the SSE2 baseline on one core.  Results may differ in the last bit between
// machines (FMA contraction), never between runs on one machine.
// (bench/cpu_kernels_check.sh defines it empty and builds once per instruction set instead.)
#ifndef BT_CPU_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && \
    defined(__linux__)
#define BT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define BT_CPU_CLONES
#endif
#endif

namespace bt::cpu {

// Note [exp without a clamp]: the reduction runs on x itself and the three specials (x > hi,
// x < lo, NaN) are selected at the end, where an earlier version clamped x into [lo, hi] first;
// the clamp's result was always selected away, and compilers emitted it as compares and blends
// on top of the final selects (2048 x 1024 float32 exps on one core with AVX-512: 0.97 -> 0.77
// ms). round(t)'s integer is read from the bits of t + 1.5 * 2^23 (the float whose ulp is 1)
// rather than converted, so an out-of-range x (whose result is selected away) is no undefined
// float-to-int conversion. Every one of the 2^32 inputs gives the bits of the clamped version,
// with and without FMA contraction, on x86-64-v4, -v3 and the baseline (checked exhaustively).
//
// exp_reduced: exp(x) = y * 2^n: n = round(x / ln 2) (as two's complement bits) and y = exp(x - n
// ln 2) in [0.7, 1.42] by the polynomial; fast_exp and fast_exp_in_range differ only in how they
// scale y.
inline float exp_reduced(float x, uint32_t& n) {
  const float t = x * 1.44269504088896341f;  // x / ln 2
  // Round to nearest by adding and removing 1.5 * 2^23 (|t| < 2^22 here): no branch, so the
  // loop vectorises (with -fno-trapping-math, see CMakeLists.txt).
  const float big = t + 12582912.0f;
  const float fn = big - 12582912.0f;
  uint32_t big_bits;
  std::memcpy(&big_bits, &big, 4);
  n = big_bits - 0x4B400000u;       // round(t), two's complement: 1.5 * 2^23 + n
  float r = x - fn * 0.693359375f;  // ln 2 split in two for an exact reduction
  r = r - fn * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  return y;
}

inline float fast_exp(float x) {
  const float hi = 88.72283905206835f, lo = -87.3365447504f;  // ln(FLT_MAX), ln(FLT_MIN)
  uint32_t n;
  const float y = exp_reduced(x, n);
  // 2^n built as 2^(n-1) * 2, so n = 128 (x near ln(FLT_MAX)) does not overflow the exponent.
  const uint32_t bits = (n + 126u) << 23;
  float p2;
  std::memcpy(&p2, &bits, 4);
  float res = y * p2 * 2.0f;
  res = x > hi ? __builtin_inff() : res;
  res = x < lo ? 0.0f : res;  // below float's normal range (std::exp would give a subnormal)
  return x != x ? x : res;
}

// Note [exp in range]
// For |x| <= 85, fast_exp's result is y * 2^(n-1) * 2 with y in [0.7, 1.42] and
// n = round(x / ln 2) in [-123, 123]: both products are exact (normal, no overflow), so it is y
// with n added to its exponent field, and none of the three specials can be selected.
// fast_exp_in_range computes that: the same operations up to y, then one integer add instead of
// two multiplies and the selects. fast_exp_block uses it for a block whose inputs all have
// |x| <= 85 (the largest |x| taken on the bits, two integer operations a vector, NaN
// included: its bits are above any finite float's) and recomputes the block with fast_exp
// otherwise, so its bits are fast_exp's for every input (bench/fast_exp_check.cpp: all 2^32
// inputs, in blocks as the kernels call it).
constexpr uint32_t kExpFastMaxBits = 0x42AA0000u;  // the bits of 85.0f

inline float fast_exp_in_range(float x) {
  uint32_t n;
  const float y = exp_reduced(x, n);
  uint32_t yb;
  std::memcpy(&yb, &y, 4);
  yb += n << 23;
  float res;
  std::memcpy(&res, &yb, 4);
  return res;
}

// e[j] = fast_exp(arg(j)) for j in [0, n), bit for bit (Note [exp in range]); arg: a cheap
// function of j, evaluated again for a block with an input out of the range.
template <typename Arg>
inline void fast_exp_block(float* __restrict e, int64_t n, Arg arg) {
  uint32_t worst = 0;  // the largest |x|'s bits
  for (int64_t j = 0; j < n; ++j) {
    const float x = arg(j);
    uint32_t xb;
    std::memcpy(&xb, &x, 4);
    xb &= 0x7FFFFFFFu;
    worst = xb > worst ? xb : worst;
    e[j] = fast_exp_in_range(x);
  }
  if (worst > kExpFastMaxBits) {
    for (int64_t j = 0; j < n; ++j) e[j] = fast_exp(arg(j));
  }
}

inline float fast_tanh(float x) {
  const float ax = x < 0 ? -x : x;
  // small |x|: odd polynomial; large: 1 - 2 / (exp(2|x|) + 1)
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float e = fast_exp(2.0f * (ax > 20.0f ? 20.0f : ax));  // tanh(20) rounds to 1
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = x < 0 ? -big : big;
  const float r = ax < 0.625f ? small : big;
  return x != x ? x : r;
}

}  // namespace bt::cpu
