// bench/cpu_kernels_check.h: what the two files of the CPU kernel check share (the second one,
// cpu_kernels_check_fwd.cpp, is compiled with FMA contraction on, as nn.cpp and elementwise.cpp
// are, for the kernels that always were).
#pragma once

#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

extern int failures;
extern int checks;
void report(const char* kernel, const char* dt, int64_t R, int64_t C, bool ok, double t_ref,
            double t_new);
// The Tanh op's contiguous loop as elementwise.cpp compiles it (fast_tanh for 16/32-bit).
template <typename T>
void tanh_loop(const T* a, T* o, int64_t n);
// softmax / log_softmax forward rows: today's kernels against v1; returns nothing (report()).
void check_softmax_forward(int reps);

inline double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

inline double best_ms(int reps, const std::function<void()>& f) {
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < reps; ++i) {
    const double t0 = cpu_seconds();
    f();
    best = std::min(best, cpu_seconds() - t0);
  }
  return 1e3 * best;
}

// Equal bits, except that any two NaNs are equal: IEEE leaves a NaN's sign and payload to the
// hardware and the operand order (x86 gives the first operand's NaN; inf - inf gives -nan), and
// a compiler may swap the operands of a commutative add.
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) continue;
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    if (!(std::isnan(x) && std::isnan(y))) return false;
  }
  return true;
}

template <typename T>
std::vector<T> random_rows(int64_t R, int64_t C, std::mt19937_64& g, bool specials) {
  std::normal_distribution<double> nd(0.3, 2.0);
  std::vector<T> v(static_cast<size_t>(R * C));
  for (auto& x : v) x = static_cast<T>(nd(g));
  if (specials && R >= 6) {  // rows 0..5: constant, huge, tiny, zeros, NaN, inf
    for (int64_t i = 0; i < C; ++i) {
      v[i] = static_cast<T>(1.25);
      v[C + i] = static_cast<T>(nd(g) * (sizeof(T) == 2 ? 1e4 : 1e30));
      v[2 * C + i] = static_cast<T>(nd(g) * (sizeof(T) == 2 ? 1e-4 : 1e-30));
      v[3 * C + i] = static_cast<T>(0.0);
    }
    v[4 * C + C / 2] = static_cast<T>(std::numeric_limits<double>::quiet_NaN());
    v[5 * C] = static_cast<T>(std::numeric_limits<double>::infinity());
  }
  return v;
}
