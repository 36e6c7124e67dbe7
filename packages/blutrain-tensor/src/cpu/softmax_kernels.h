// cpu/softmax_kernels.h: the CPU softmax row kernels, forward (instantiated in nn.cpp, whose
// BT_CPU_CLONES code contracts multiply-adds on FMA machines, as it always has) and backward
// and cross_entropy's gradient (nn_fused.cpp, -ffp-contract=off: the first, baseline-compiled
// version had no FMA); plain functions over raw rows so bench/cpu_kernels_check.sh can check them
// bit for bit against scalar references on every ISA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../dtype.h"  // compute_t
#include "fastmath.h"
#include "widen.h"

namespace bt::cpu::softmax {

// exp in the compute type: the vectorisable float32 version for 16/32-bit inputs.
inline float exp_c(float x) { return cpu::fast_exp(x); }
inline double exp_c(double x) { return std::exp(x); }

// e[j] = exp_c(arg(j)), j in [0, n): for float, fast_exp_block (Note [exp in range] in
// fastmath.h: the same bits, fewer operations where the block's inputs are in range).
template <typename A, typename Arg>
inline void exp_block(A* e, int64_t n, Arg arg) {
  if constexpr (std::is_same_v<A, float>) {
    cpu::fast_exp_block(e, n, arg);
  } else {
    for (int64_t j = 0; j < n; ++j) e[j] = exp_c(arg(j));
  }
}

// Row statistics with kLanes independent accumulators (a fixed order: deterministic) so the
// compiler vectorises them; a single running max or sum is a dependency chain it must keep
// scalar.  Exp sums accumulate in double, kLanes of them, each in index order.
constexpr int kLanes = 8;
// The max keeps kMaxLanes: its result does not depend on the order (NaN is ignored by every
// lane like std::max(m, v); a -0 / +0 tie changes no later result: x - m and m + log(s) are the
// same for either zero), so it takes the lanes that hide the compare's latency: four 8-wide
// chains on AVX2, two 16-wide on AVX-512 (8 lanes made it most of the softmax's time: 2048 x
// 1024 float32, 2.5 -> 1.3 ms on one core with AVX-512).
constexpr int kMaxLanes = 32;

template <typename A, typename T>
BT_CPU_CLONES A row_max(const T* p, int64_t C) {
  A m[kMaxLanes];
  for (int k = 0; k < kMaxLanes; ++k) m[k] = -std::numeric_limits<A>::infinity();
  int64_t i = 0;
  for (; i + kMaxLanes <= C; i += kMaxLanes) {
    for (int k = 0; k < kMaxLanes; ++k) {
      const A v = static_cast<A>(p[i + k]);
      m[k] = v > m[k] ? v : m[k];
    }
  }
  for (; i < C; ++i) m[0] = std::max<A>(m[0], static_cast<A>(p[i]));
  A r = m[0];
  for (int k = 1; k < kMaxLanes; ++k) r = std::max<A>(r, m[k]);
  return r;
}

// sum(exp(p[i] - m)) in double; with `sum_x`, also sum(p[i]) (label smoothing).
// Note [exp, then sum]: for a float compute type the exponentials of a block go to a scratch
// array first and are summed in a second loop, the same values into the same lanes in the same
// order (same bits), because one loop that does both vectorises neither well (the float exp
// at half width, the double sums' chains exposed): 1.6x less time for the pair on one core.
constexpr int64_t kExpBlock = 512;  // floats of scratch (2 KB, in L1 with its row)

template <typename A, typename T>
BT_CPU_CLONES double row_exp_sum(const T* p, int64_t C, A m, double* sum_x = nullptr) {
  double s[kLanes] = {}, sx[kLanes] = {};
  const int64_t full = C / kLanes * kLanes;
  if constexpr (std::is_same_v<A, float>) {
    float e[kExpBlock];
    for (int64_t b = 0; b < full; b += kExpBlock) {
      const int64_t n = std::min(kExpBlock, full - b);  // a multiple of kLanes
      for (int64_t j = 0; j < n; ++j) e[j] = exp_c(static_cast<A>(p[b + j]) - m);
      for (int64_t j = 0; j < n; j += kLanes) {
        for (int k = 0; k < kLanes; ++k) s[k] += static_cast<double>(e[j + k]);
      }
      if (sum_x) {
        for (int64_t j = 0; j < n; j += kLanes) {
          for (int k = 0; k < kLanes; ++k) {
            sx[k] += static_cast<double>(static_cast<A>(p[b + j + k]));
          }
        }
      }
    }
  } else {
    for (int64_t i = 0; i < full; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const A v = static_cast<A>(p[i + k]);
        s[k] += static_cast<double>(exp_c(v - m));
        sx[k] += static_cast<double>(v);
      }
    }
  }
  for (int64_t i = full; i < C; ++i) {
    s[0] += static_cast<double>(exp_c(static_cast<A>(p[i]) - m));
    sx[0] += static_cast<double>(p[i]);
  }
  double r = 0, rx = 0;
  for (int k = 0; k < kLanes; ++k) {
    r += s[k];
    rx += sx[k];
  }
  if (sum_x) *sum_x = rx;
  return r;
}

// q = exp(p - m) * inv (softmax) or (p - m) - log(s) (log_softmax: m + log(s) first would round
// log(s) away for a large m), one row.
template <typename A, typename T>
BT_CPU_CLONES void softmax_row_out(const T* p, T* q, int64_t C, A m, A inv, A log_s, bool lg) {
  if (lg) {
    for (int64_t i = 0; i < C; ++i) q[i] = static_cast<T>((static_cast<A>(p[i]) - m) - log_s);
  } else {
    for (int64_t i = 0; i < C; ++i) q[i] = static_cast<T>(exp_c(static_cast<A>(p[i]) - m) * inv);
  }
}

// softmax_row_store: for float32 rows, row_exp_sum's sum with each exp(p[i] - m) also stored in
// q (the same lanes, the same order, the same inlined exp), so the output pass only scales:
// exp(p - m) * inv rounds as softmax_row_out's did, with half the exponentials.
// (Templates, like every kernel here: instantiated only in the file that calls them, so a file
// compiled with other flags never emits a copy the linker could pick instead.)
template <typename F>
BT_CPU_CLONES double row_exp_sum_store(const F* p, F* q, int64_t C, F m) {
  for (int64_t i = 0; i < C; ++i) q[i] = exp_c(p[i] - m);  // Note [exp, then sum]
  double s[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= C; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) s[k] += static_cast<double>(q[i + k]);
  }
  for (; i < C; ++i) s[0] += static_cast<double>(q[i]);
  double r = 0;
  for (int k = 0; k < kLanes; ++k) r += s[k];
  return r;
}

template <typename F>
BT_CPU_CLONES void scale_row(F* q, int64_t C, F inv) {
  for (int64_t i = 0; i < C; ++i) q[i] = q[i] * inv;
}

// ---- backward: dx = y * (dy - sum(dy * y)) (softmax), dy - exp(y) * sum(dy) (log_softmax) ----
// The sums in double over kSumLanes lanes (Note [lane sums] in norm_kernels.h: a fixed order,
// vectorised; one index-order chain a row, even with 4 rows in flight, was more than half the
// kernel's time: 2048 x 1024 float32, 2.0 -> 0.9 ms on one core).
constexpr int kSumLanes = 16;

template <bool LOG, typename T>
BT_CPU_CLONES double backward_sum(const T* y, const T* g, int64_t C) {
#if BT_CPU_WIDEN
  if constexpr (LOG && std::is_same_v<T, float>) {  // Note [widening loops]
    if (widen::use_avx2()) return widen::lane_sum_avx2(g, C);
  }
#endif
  const int64_t full = C / kSumLanes * kSumLanes;
  double a[kSumLanes] = {};
  auto term = [&](int64_t i) {
    return LOG ? static_cast<double>(g[i]) : static_cast<double>(g[i]) * static_cast<double>(y[i]);
  };
  for (int64_t i = 0; i < full; i += kSumLanes) {
    for (int k = 0; k < kSumLanes; ++k) a[k] += term(i + k);
  }
  for (int64_t i = full; i < C; ++i) a[0] += term(i);
  double r = 0;
  for (int k = 0; k < kSumLanes; ++k) r += a[k];
  return r;
}

template <typename T>
BT_CPU_CLONES void softmax_dx_row(const T* y, const T* g, T* q, int64_t C, double s) {
  for (int64_t i = 0; i < C; ++i) {
    const double yv = static_cast<double>(y[i]), gv = static_cast<double>(g[i]);
    q[i] = static_cast<T>(yv * (gv - s));
  }
}

// exp(y) for 16/32-bit rows is the forward's float exp (fast_exp, vectorised: libm's double exp
// per element was 90% of this kernel's time); the rest in double as before. A block's float
// exps go to a scratch first (Note [exp, then sum]: a loop mixing them with double math runs
// the exp at half width); float32 rows take the double step in widen.h's loop (Note [widening
// loops]).
template <typename T>
BT_CPU_CLONES void log_softmax_dx_row(const T* y, const T* g, T* q, int64_t C, double s) {
  using A = compute_t<T>;
  A e[kExpBlock];
  for (int64_t b = 0; b < C; b += kExpBlock) {
    const int64_t n = std::min(kExpBlock, C - b);
    exp_block(e, n, [&](int64_t j) { return static_cast<A>(y[b + j]); });
    if constexpr (std::is_same_v<T, float>) {
      widen::sub_scaled(g + b, e, q + b, n, s);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        q[b + j] = static_cast<T>(static_cast<double>(g[b + j]) - static_cast<double>(e[j]) * s);
      }
    }
  }
}

template <bool LOG, typename T>
void backward_rows_log(const T* y, const T* dy, T* dx, int64_t r0, int64_t r1, int64_t C) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t o = r * C;
    const double s = backward_sum<LOG>(y + o, dy + o, C);
    if constexpr (LOG) {
      log_softmax_dx_row(y + o, dy + o, dx + o, C, s);
    } else {
      softmax_dx_row(y + o, dy + o, dx + o, C, s);
    }
  }
}

// Rows [r0, r1) of dx for y (the forward's output), dy: (R, C) contiguous.
template <typename T>
void backward_rows(const T* y, const T* dy, T* dx, int64_t r0, int64_t r1, int64_t C, bool log) {
  if (log) {
    backward_rows_log<true>(y, dy, dx, r0, r1, C);
  } else {
    backward_rows_log<false>(y, dy, dx, r0, r1, C);
  }
}

// ---- cross_entropy backward: one row of dlogits ------------------------------------------------
// d[i] = (exp(x[i] - lse) - ls / C - (i == target) * (1 - ls)) * scale over the C classes, the
// padding columns [C, Cx) zero. The exponent x - lse is taken in double and rounded once to the
// compute type, whose exp (float's fast_exp, vectorised, for 16/32-bit logits) gives e; the rest
// in double. `target` < 0: no target term. q may be p (written in place).
template <typename T>
BT_CPU_CLONES void ce_grad_row(const T* p, T* q, int64_t C, int64_t Cx, double lse, double scale,
                               double off, double ls, int64_t target) {
  using A = compute_t<T>;
  auto arg = [&](int64_t i) { return static_cast<A>(static_cast<double>(p[i]) - lse); };
  double dt = 0;
  if (target >= 0) {  // before the row is written: q may be p (dlogits over the logits)
    dt = static_cast<double>(exp_c(arg(target))) - off;
    dt -= 1.0 - ls;
  }
  A e[kExpBlock];  // Note [exp, then sum]: the float exps first, at full width
  for (int64_t b = 0; b < C; b += kExpBlock) {
    const int64_t n = std::min(kExpBlock, C - b);
    if constexpr (std::is_same_v<T, float>) {  // Note [widening loops]
      float a[kExpBlock];  // the block's exponents, read before q (which may be p) is written
      widen::shift_round(p + b, a, n, lse);
      exp_block(e, n, [&](int64_t j) { return a[j]; });
      widen::offset_scale(e, q + b, n, off, scale);
      continue;
    }
    exp_block(e, n, [&](int64_t j) { return arg(b + j); });
    for (int64_t j = 0; j < n; ++j) {
      q[b + j] = static_cast<T>((static_cast<double>(e[j]) - off) * scale);
    }
  }
  for (int64_t i = C; i < Cx; ++i) q[i] = static_cast<T>(0.0);
  if (target >= 0) q[target] = static_cast<T>(dt * scale);
}

}  // namespace bt::cpu::softmax
