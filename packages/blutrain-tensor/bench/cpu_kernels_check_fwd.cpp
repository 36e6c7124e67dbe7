// bench/cpu_kernels_check_fwd.cpp: the kernels compiled as nn.cpp and elementwise.cpp compile
// them, FMA contraction on (see cpu_kernels_check.cpp): the softmax forward rows against v1,
// and the Tanh op's loop for the GELU backward check. v1: the forward rows as first written.
#include <cstdio>

#include "../src/cpu/softmax_kernels.h"
#include "../src/dtype.h"
#include "cpu_kernels_check.h"

using bt::bfloat16;
using bt::float16;

template <typename T>
void tanh_loop(const T* a, T* o, int64_t n) {
  using C = bt::compute_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<C, float>) {
      o[i] = static_cast<T>(bt::cpu::fast_tanh(static_cast<C>(a[i])));
    } else {
      o[i] = static_cast<T>(std::tanh(static_cast<C>(a[i])));
    }
  }
}
template void tanh_loop<float>(const float*, float*, int64_t);
template void tanh_loop<double>(const double*, double*, int64_t);
template void tanh_loop<bfloat16>(const bfloat16*, bfloat16*, int64_t);
template void tanh_loop<float16>(const float16*, float16*, int64_t);

namespace v1 {  // the forward row kernels as first written: 8-lane max, exp and sums in one loop
constexpr int kLanes = 8;
using bt::cpu::softmax::exp_c;

template <typename A, typename T>
A row_max(const T* p, int64_t C) {
  A m[kLanes];
  for (int k = 0; k < kLanes; ++k) m[k] = -std::numeric_limits<A>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= C; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const A v = static_cast<A>(p[i + k]);
      m[k] = v > m[k] ? v : m[k];
    }
  }
  for (; i < C; ++i) m[0] = std::max<A>(m[0], static_cast<A>(p[i]));
  A r = m[0];
  for (int k = 1; k < kLanes; ++k) r = std::max<A>(r, m[k]);
  return r;
}

template <typename A, typename T>
double row_exp_sum(const T* p, int64_t C, A m, double* sum_x) {
  double s[kLanes] = {}, sx[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= C; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const A v = static_cast<A>(p[i + k]);
      s[k] += static_cast<double>(exp_c(v - m));
      sx[k] += static_cast<double>(v);
    }
  }
  for (; i < C; ++i) {
    s[0] += static_cast<double>(exp_c(static_cast<A>(p[i]) - m));
    sx[0] += static_cast<double>(p[i]);
  }
  double r = 0, rx = 0;
  for (int k = 0; k < kLanes; ++k) {
    r += s[k];
    rx += sx[k];
  }
  *sum_x = rx;
  return r;
}

// Rows of softmax / log_softmax; stats (when given) gets m, s, sum_x per row (cross_entropy's).
template <typename T>
void softmax(const T* xp, T* o, double* stats, int64_t rows, int64_t C, bool lg) {
  using A = bt::compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = xp + r * C;
    T* q = o + r * C;
    A m = row_max<A>(p, C);
    if (std::isinf(m) && m < 0) m = 0;
    double sx = 0;
    const double s = row_exp_sum<A>(p, C, m, &sx);
    for (int64_t i = 0; i < C; ++i) {
      q[i] = lg ? static_cast<T>((static_cast<A>(p[i]) - m) - static_cast<A>(std::log(s)))
                : static_cast<T>(exp_c(static_cast<A>(p[i]) - m) * static_cast<A>(1.0 / s));
    }
    if (stats) {
      stats[3 * r] = static_cast<double>(m);
      stats[3 * r + 1] = s;
      stats[3 * r + 2] = sx;
    }
  }
}
}  // namespace v1

namespace {
using namespace bt::cpu::softmax;

// Today's rows, as nn.cpp runs them (float32 softmax: the stored exponentials, then a scale).
template <typename T>
void softmax_now(const T* xp, T* o, double* stats, int64_t rows, int64_t C, bool lg) {
  using A = bt::compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = xp + r * C;
    T* q = o + r * C;
    A m = row_max<A>(p, C);
    if (std::isinf(m) && m < 0) m = 0;
    double sx = 0, s;
    if constexpr (std::is_same_v<T, float>) {
      if (!lg && !stats) {
        s = row_exp_sum_store(p, q, C, m);
        scale_row(q, C, static_cast<float>(1.0 / s));
        continue;
      }
    }
    s = row_exp_sum<A>(p, C, m, &sx);
    softmax_row_out<A>(p, q, C, m, static_cast<A>(1.0 / s), static_cast<A>(std::log(s)), lg);
    if (stats) {
      stats[3 * r] = static_cast<double>(m);
      stats[3 * r + 1] = s;
      stats[3 * r + 2] = sx;
    }
  }
}

template <typename T>
void check_rows(const char* dt, std::mt19937_64& g, int reps) {
  const int64_t shapes[][2] = {{1, 1},      {3, 5},       {7, 127},   {9, 600},
                               {4096, 128}, {2048, 1024}, {16, 50304}};
  for (const auto& sh : shapes) {
    const int64_t R = sh[0], C = sh[1];
    auto x = random_rows<T>(R, C, g, true);
    if (R > 6) {  // a masked row (causal attention): -inf but for the first column; all -inf
      for (int64_t i = 1; i < C; ++i) x[6 * C + i] = static_cast<T>(-INFINITY);
    }
    if (R > 8) x[8 * C + C - 1] = static_cast<T>(-0.0);  // a -0 / +0 max tie
    if (R > 8) x[8 * C] = static_cast<T>(0.0);
    std::vector<T> a(x.size()), b(x.size());
    std::vector<double> sa(3 * R), sb(3 * R);
    for (int mode = 0; mode < 3; ++mode) {  // softmax, log_softmax, cross_entropy's statistics
      const bool lg = mode == 1;
      double* pa = mode == 2 ? sa.data() : nullptr;
      double* pb = mode == 2 ? sb.data() : nullptr;
      const double ta = best_ms(reps, [&] { v1::softmax<T>(x.data(), a.data(), pa, R, C, lg); });
      const double tb = best_ms(reps, [&] { softmax_now<T>(x.data(), b.data(), pb, R, C, lg); });
      const char* name = mode == 0   ? "softmax"
                         : mode == 1 ? "log_softmax"
                                     : "ce stats (m, s, sum x)";
      report(name, dt, R, C, same_bits(a, b) && (mode < 2 || same_bits(sa, sb)), ta, tb);
    }
  }
}
}  // namespace

void check_softmax_forward(int reps) {
  std::mt19937_64 g(99);
  check_rows<float>("float32", g, reps);
  check_rows<double>("float64", g, reps);
  check_rows<bfloat16>("bfloat16", g, reps);
}
