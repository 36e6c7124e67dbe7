// random.h: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11),
// the counter-based generator that CPU and CUDA kernels share (it is host/device code: plain
// integer arithmetic, no state).
//
// The numbers a (seed, offset) pair gives, element i of the output (in row-major order):
//   words  = philox(key = (seed lo, seed hi), counter = (offset + i / 4, 0, 0, 0))
//   uniform float32/16/bf16: u = ((words[i % 4] >> 8) + 0.5) * 2^-24, mapped to [a, b)
//   uniform float64: counter offset + i / 2, 53 bits from words[2 (i%2)], words[2 (i%2) + 1]
//   normal: Box-Muller on the pair (words[0], words[1]) for i % 4 in {0, 1} and (words[2],
//           words[3]) for {2, 3}: r = sqrt(-2 ln u1), z = r cos(2 pi u2) or r sin(2 pi u2),
//           computed in double (a CUDA kernel that computes in float matches to ~1 ulp)
//   int in [a, b): a + words[i % 4] % (b - a)   (ranges up to 2^32)
//   dropout keeps element i when its uniform float32 u >= p.
// Each call takes counters_needed(n) counters from the global generator's offset, so
// consecutive calls never reuse a counter.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define BT_HD __host__ __device__ __forceinline__
#else
#define BT_HD inline
#endif

namespace bt::philox {

struct U4 {
  uint32_t x[4];
};

BT_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

BT_HD U4 philox4x32_10(uint64_t seed, uint64_t counter) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32), c2 = 0,
           c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(0xD2511F53u, c0, hi0, lo0);
    mulhilo(0xCD9E8D57u, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return U4{{c0, c1, c2, c3}};
}

BT_HD float u32_to_unit_float(uint32_t w) {  // (0, 1)
  return (static_cast<float>(w >> 8) + 0.5f) * (1.0f / 16777216.0f);
}
BT_HD double u64_to_unit_double(uint32_t hi, uint32_t lo) {  // (0, 1)
  const uint64_t v = ((static_cast<uint64_t>(hi) << 32) | lo) >> 11;
  return (static_cast<double>(v) + 0.5) * (1.0 / 9007199254740992.0);
}

BT_HD float uniform_f32(uint64_t seed, uint64_t offset, uint64_t i) {
  return u32_to_unit_float(philox4x32_10(seed, offset + i / 4).x[i % 4]);
}
BT_HD double uniform_f64(uint64_t seed, uint64_t offset, uint64_t i) {
  const U4 w = philox4x32_10(seed, offset + i / 2);
  const int j = static_cast<int>(i % 2) * 2;
  return u64_to_unit_double(w.x[j], w.x[j + 1]);
}
BT_HD double normal(uint64_t seed, uint64_t offset, uint64_t i) {
  const U4 w = philox4x32_10(seed, offset + i / 4);
  const int lane = static_cast<int>(i % 4), p = lane / 2 * 2;
  const double u1 = u32_to_unit_float(w.x[p]), u2 = u32_to_unit_float(w.x[p + 1]);
  const double r = std::sqrt(-2.0 * std::log(u1)), th = 6.283185307179586 * u2;
  return (lane % 2 == 0) ? r * std::cos(th) : r * std::sin(th);
}
BT_HD uint32_t bits(uint64_t seed, uint64_t offset, uint64_t i) {
  return philox4x32_10(seed, offset + i / 4).x[i % 4];
}

inline uint64_t counters_needed(uint64_t n, bool f64_uniform) {
  return f64_uniform ? (n + 1) / 2 : (n + 3) / 4;
}

}  // namespace bt::philox
