// cpu/widen.h: the float32 <-> double element loops of the row kernels (softmax_kernels.h,
// norm_kernels.h) written with AVX2 intrinsics, picked at run time where the CPU has AVX2.
//
// Note [widening loops]
// A float32 row's statistics and gradients are double arithmetic: each element widened, a few
// double operations, the result rounded back to float. GCC (12) vectorises such a loop by
// loading a whole float vector and converting its two halves (an extract a half) and narrows the
// same way (an insert), so a third of the loop was shuffles: on one Zen 4 core, 2048 x 1024,
// q = float(g - e * s) took 0.48 ms as compiled and 0.34 ms converting 4 floats straight from
// memory (vcvtps2pd ymm, m128), as these loops do. Each element gets the same IEEE operations in
// the same order as the plain C++ beside it (no contraction: the target is AVX2 without FMA),
// so the bits are the same on every CPU; the plain loops run where AVX2 is missing, or
// everywhere when BT_CPU_WIDEN is 0 (bench/cpu_kernels_check.sh builds its baseline so).
#pragma once

#include <cstdint>

#ifndef BT_CPU_WIDEN
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define BT_CPU_WIDEN 1
#else
#define BT_CPU_WIDEN 0
#endif
#endif

#if BT_CPU_WIDEN
#include <immintrin.h>
#define BT_AVX2 __attribute__((target("avx2")))
#endif

namespace bt::cpu::widen {

#if BT_CPU_WIDEN
inline bool use_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

BT_AVX2 inline void sub_scaled_avx2(const float* g, const float* e, float* q, int64_t n, double s) {
  const __m256d sv = _mm256_set1_pd(s);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const __m256d gv = _mm256_cvtps_pd(_mm_loadu_ps(g + j));
    const __m256d ev = _mm256_cvtps_pd(_mm_loadu_ps(e + j));
    _mm_storeu_ps(q + j, _mm256_cvtpd_ps(_mm256_sub_pd(gv, _mm256_mul_pd(ev, sv))));
  }
  for (; j < n; ++j)
    q[j] = static_cast<float>(static_cast<double>(g[j]) - static_cast<double>(e[j]) * s);
}

BT_AVX2 inline void shift_round_avx2(const float* p, float* a, int64_t n, double c) {
  const __m256d cv = _mm256_set1_pd(c);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const __m256d pv = _mm256_cvtps_pd(_mm_loadu_ps(p + j));
    _mm_storeu_ps(a + j, _mm256_cvtpd_ps(_mm256_sub_pd(pv, cv)));
  }
  for (; j < n; ++j) a[j] = static_cast<float>(static_cast<double>(p[j]) - c);
}

BT_AVX2 inline void offset_scale_avx2(const float* e, float* q, int64_t n, double off,
                                      double scale) {
  const __m256d ov = _mm256_set1_pd(off), sv = _mm256_set1_pd(scale);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const __m256d ev = _mm256_cvtps_pd(_mm_loadu_ps(e + j));
    _mm_storeu_ps(q + j, _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_sub_pd(ev, ov), sv)));
  }
  for (; j < n; ++j) q[j] = static_cast<float>((static_cast<double>(e[j]) - off) * scale);
}

// sum(double(g[i])) over 16 double lanes (Note [lane sums] in norm_kernels.h: lane k adds
// elements k, k + 16, ... in order, the tail goes to lane 0, the lanes are added 0, 1, ...).
BT_AVX2 inline double lane_sum_avx2(const float* g, int64_t C) {
  constexpr int L = 16;
  const int64_t full = C / L * L;
  __m256d a[4];
  for (int k = 0; k < 4; ++k) a[k] = _mm256_setzero_pd();
  for (int64_t i = 0; i < full; i += L) {
    for (int k = 0; k < 4; ++k)
      a[k] = _mm256_add_pd(a[k], _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4 * k)));
  }
  double al[L];
  for (int k = 0; k < 4; ++k) _mm256_storeu_pd(al + 4 * k, a[k]);
  for (int64_t i = full; i < C; ++i) al[0] += static_cast<double>(g[i]);
  double r = 0;
  for (int k = 0; k < L; ++k) r += al[k];
  return r;
}

// layer_norm's row statistics: s = sum(double(p[i])), then m = s / C and
// ss = sum((double(p[i]) - m)^2), each over 16 lanes as lane_sum_avx2.
BT_AVX2 inline void ln_stats_avx2(const float* p, int64_t C, double* mean, double* sumsq) {
  constexpr int L = 16;
  const int64_t full = C / L * L;
  const double m = lane_sum_avx2(p, C) / static_cast<double>(C);
  const __m256d mv = _mm256_set1_pd(m);
  __m256d a[4];
  for (int k = 0; k < 4; ++k) a[k] = _mm256_setzero_pd();
  for (int64_t i = 0; i < full; i += L) {
    for (int k = 0; k < 4; ++k) {
      const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(p + i + 4 * k)), mv);
      a[k] = _mm256_add_pd(a[k], _mm256_mul_pd(d, d));
    }
  }
  double al[L];
  for (int k = 0; k < 4; ++k) _mm256_storeu_pd(al + 4 * k, a[k]);
  for (int64_t i = full; i < C; ++i) {
    const double d = static_cast<double>(p[i]) - m;
    al[0] += d * d;
  }
  double r = 0;
  for (int k = 0; k < L; ++k) r += al[k];
  *mean = m;
  *sumsq = r;
}

// ---- layer-norm backward (norm_kernels.h), float32 dy, x, dx: the same lanes and order ----------
// backward_sums: s1 = sum(gx) / C, s2 = sum((gx * (x - m)) * rs) / C over 16 double lanes
// (Note [lane sums]: four 4-double vectors are lanes 0-15), gx = dy * w (W) or dy.
template <bool W>
BT_AVX2 inline void ln_sums_avx2(const float* g, const float* p, const double* w, double m,
                                 double rs, int64_t C, double* s1, double* s2) {
  constexpr int L = 16;
  const int64_t full = C / L * L;
  const __m256d mv = _mm256_set1_pd(m), rv = _mm256_set1_pd(rs);
  __m256d a[4], c[4];
  for (int k = 0; k < 4; ++k) a[k] = _mm256_setzero_pd(), c[k] = _mm256_setzero_pd();
  for (int64_t i = 0; i < full; i += L) {
    for (int k = 0; k < 4; ++k) {
      __m256d gx = _mm256_cvtps_pd(_mm_loadu_ps(g + i + 4 * k));
      if constexpr (W) gx = _mm256_mul_pd(gx, _mm256_loadu_pd(w + i + 4 * k));
      a[k] = _mm256_add_pd(a[k], gx);
      const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(p + i + 4 * k)), mv);
      c[k] = _mm256_add_pd(c[k], _mm256_mul_pd(_mm256_mul_pd(gx, d), rv));
    }
  }
  double al[L], cl[L];
  for (int k = 0; k < 4; ++k)
    _mm256_storeu_pd(al + 4 * k, a[k]), _mm256_storeu_pd(cl + 4 * k, c[k]);
  for (int64_t i = full; i < C; ++i) {
    const double gx = static_cast<double>(g[i]) * (W ? w[i] : 1.0);
    al[0] += gx;
    cl[0] += gx * (static_cast<double>(p[i]) - m) * rs;
  }
  double ra = 0, rc = 0;
  for (int k = 0; k < L; ++k) ra += al[k], rc += cl[k];
  *s1 = ra / static_cast<double>(C);
  *s2 = rc / static_cast<double>(C);
}
#endif

// q[j] = float(double(g[j]) - double(e[j]) * s): the log_softmax backward's dx.
inline void sub_scaled(const float* g, const float* e, float* q, int64_t n, double s) {
#if BT_CPU_WIDEN
  if (use_avx2()) return sub_scaled_avx2(g, e, q, n, s);
#endif
  for (int64_t j = 0; j < n; ++j) {
    q[j] = static_cast<float>(static_cast<double>(g[j]) - static_cast<double>(e[j]) * s);
  }
}

// a[j] = float(double(p[j]) - c): cross_entropy's exponent x - lse, rounded once.
inline void shift_round(const float* p, float* a, int64_t n, double c) {
#if BT_CPU_WIDEN
  if (use_avx2()) return shift_round_avx2(p, a, n, c);
#endif
  for (int64_t j = 0; j < n; ++j) a[j] = static_cast<float>(static_cast<double>(p[j]) - c);
}

// q[j] = float((double(e[j]) - off) * scale): cross_entropy's gradient from its exp.
inline void offset_scale(const float* e, float* q, int64_t n, double off, double scale) {
#if BT_CPU_WIDEN
  if (use_avx2()) return offset_scale_avx2(e, q, n, off, scale);
#endif
  for (int64_t j = 0; j < n; ++j)
    q[j] = static_cast<float>((static_cast<double>(e[j]) - off) * scale);
}

}  // namespace bt::cpu::widen
