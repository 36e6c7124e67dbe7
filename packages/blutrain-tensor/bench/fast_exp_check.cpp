// bench/fast_exp_check.cpp: cpu/fastmath.h's fast_exp against its first (clamped) version on
// every one of the 2^32 float inputs, bit for bit, vectorised and scalar (Note [exp without a
// clamp]), and fast_exp_block (Note [exp in range]) on the same inputs in blocks of 512, as the
// softmax / cross-entropy backward kernels call it. Built by fast_exp_check.sh per instruction set,
// with FMA contraction on and off (the kernels' two builds).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../src/cpu/fastmath.h"

namespace v1 {
inline float fast_exp(float x) {  // the version before Note [exp without a clamp]
  const float hi = 88.72283905206835f, lo = -87.3365447504f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  const float t = xc * 1.44269504088896341f;
  const float fn = (t + 12582912.0f) - 12582912.0f;
  const int32_t n = static_cast<int32_t>(fn);
  float r = xc - fn * 0.693359375f;
  r = r - fn * -2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = (n + 126) << 23;
  float p2;
  std::memcpy(&p2, &bits, 4);
  float res = y * p2 * 2.0f;
  res = x > hi ? __builtin_inff() : res;
  res = x < lo ? 0.0f : res;
  return x != x ? x : res;
}
}  // namespace v1

__attribute__((noinline)) void v1_loop(const float* __restrict a, float* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = v1::fast_exp(a[i]);
}
__attribute__((noinline)) void now_loop(const float* __restrict a, float* __restrict o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = bt::cpu::fast_exp(a[i]);
}
// fast_exp_block as the backward kernels use it: blocks of 512 (a short last one)
__attribute__((noinline)) void block_loop(const float* __restrict a, float* __restrict o,
                                          int64_t n) {
  for (int64_t b = 0; b < n; b += 512) {
    const int64_t m = n - b < 512 ? n - b : 512;
    bt::cpu::fast_exp_block(o + b, m, [&](int64_t j) { return a[b + j]; });
  }
}

int main() {
  const int64_t N = int64_t{1} << 22;  // inputs a batch
  std::vector<float> a(N), o1(N), o2(N), o3(N);
  int64_t diff = 0, diff_block = 0;
  double t1 = 0, t2 = 0;
  auto note = [&](uint32_t b, float p, float q) {
    if (++diff <= 5) std::printf("differs at 0x%08x: v1 %a now %a\n", b, p, q);
  };
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += N) {
    for (int64_t i = 0; i < N; ++i) {
      const uint32_t b = static_cast<uint32_t>(base + i);
      std::memcpy(&a[i], &b, 4);
    }
    auto c0 = std::chrono::steady_clock::now();
    v1_loop(a.data(), o1.data(), N);
    auto c1 = std::chrono::steady_clock::now();
    now_loop(a.data(), o2.data(), N);
    auto c2 = std::chrono::steady_clock::now();
    t1 += std::chrono::duration<double>(c1 - c0).count();
    t2 += std::chrono::duration<double>(c2 - c1).count();
    block_loop(a.data(), o3.data(), N);
    for (int64_t i = 0; i < N; ++i) {
      if (std::memcmp(&o1[i], &o2[i], 4) != 0) note(static_cast<uint32_t>(base + i), o1[i], o2[i]);
      if (std::memcmp(&o1[i], &o3[i], 4) != 0 && ++diff_block <= 5) {
        std::printf("block differs at 0x%08x: v1 %a now %a\n", static_cast<uint32_t>(base + i),
                    o1[i], o3[i]);
      }
    }
  }
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 4097) {  // the scalar (one-element) path
    float x, p, q;
    const uint32_t u = static_cast<uint32_t>(b);
    std::memcpy(&x, &u, 4);
    v1_loop(&x, &p, 1);
    now_loop(&x, &q, 1);
    if (std::memcmp(&p, &q, 4) != 0) note(u, p, q);
  }
  std::printf("2^32 inputs: %lld differ; v1 %.2f s, now %.2f s; fast_exp_block: %lld differ\n",
              static_cast<long long>(diff), t1, t2, static_cast<long long>(diff_block));
  return diff != 0 || diff_block != 0;
}
