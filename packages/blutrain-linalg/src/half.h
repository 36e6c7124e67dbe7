// Scalar fp16 / bf16 conversions (bit exact, round-to-nearest-even) and GELU, shared by the
// CPU backend; host-only (the CUDA kernels use cuda_fp16.h / cuda_bf16.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace blutrain::linalg {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // Subnormal: value = man * 2^-24.
    float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;   // nan
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (u < 0x38800000u) {                        // below 2^-14: subnormal or zero
    // Scale so the subnormal step 2^-24 becomes 1, round to nearest even.
    float v = bits_f32(u) * 16777216.0f;  // exact: power-of-two scale
    return sign | uint16_t(std::nearbyint(v));
  }
  uint32_t r = u + 0xfffu + ((u >> 13) & 1u);
  return sign | uint16_t(((r >> 13) - (112u << 10)) & 0x7fffu);
}

// Operand rounding that emulates the GPU compute modes on the CPU.
inline float round_tf32(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf / nan unchanged
  u += 0xfffu + ((u >> 13) & 1u);
  return bits_f32(u & 0xffffe000u);
}
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

// GELU, tanh form, and its derivative.
constexpr double kGeluS = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluC = 0.044715;
template <class T>
inline T gelu(T z) {
  const T t = std::tanh(T(kGeluS) * (z + T(kGeluC) * z * z * z));
  return T(0.5) * z * (T(1) + t);
}
template <class T>
inline T dgelu(T z) {
  const T t = std::tanh(T(kGeluS) * (z + T(kGeluC) * z * z * z));
  return T(0.5) * (T(1) + t) +
         T(0.5) * z * (T(1) - t * t) * T(kGeluS) * (T(1) + T(3 * kGeluC) * z * z);
}

}  // namespace blutrain::linalg
