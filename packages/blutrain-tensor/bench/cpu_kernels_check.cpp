// bench/cpu_kernels_check.cpp: the CPU row kernels against their first versions, bit for bit,
// and timed (llm.c's dev/ habit: v1 is the reference, production keeps the winner).
//
//   bash bench/cpu_kernels_check.sh      # builds this once per instruction set and runs each
//
// v1 (below) is the scalar code each kernel replaced, kept verbatim in its arithmetic. The
// production kernels (src/cpu/norm_kernels.h) must give the same bits on every instruction set:
// this file is built with BT_CPU_CLONES empty and -march=x86-64-v4, -v3 and the baseline in
// turn (what target_clones picks at load time on such machines), -ffp-contract=off as
// CMakeLists.txt compiles those kernels. Inputs: random rows of several widths, plus rows of
// equal values, huge and tiny magnitudes, zeros, and a NaN and an infinity. Times are the
// calling thread's CPU time (best of --reps), so a busy machine inflates them less than wall
// time would.
#include <time.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../src/cpu/norm_kernels.h"
#include "../src/dtype.h"

using bt::bfloat16;
using bt::float16;

namespace v1 {  // the first CPU kernels (row by row, one chain per sum)

template <typename T, typename S>
void layer_norm(const T* xp, const T* wp, const T* bp, T* y, S* mean_o, S* rstd_o, int64_t rows,
                int64_t C, double e) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = xp + r * C;
    double s = 0;
    for (int64_t i = 0; i < C; ++i) s += static_cast<double>(p[i]);
    const double mean = s / static_cast<double>(C);
    double ss = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double d = static_cast<double>(p[i]) - mean;
      ss += d * d;
    }
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(C) + e);
    mean_o[r] = static_cast<S>(mean);
    rstd_o[r] = static_cast<S>(rstd);
    T* q = y + r * C;
    for (int64_t i = 0; i < C; ++i) {
      double v = (static_cast<double>(p[i]) - mean) * rstd;
      if (wp) v *= static_cast<double>(wp[i]);
      if (bp) v += static_cast<double>(bp[i]);
      q[i] = static_cast<T>(v);
    }
  }
}

template <typename T, typename S>
void add_layer_norm(const T* xp, const T* rp, const T* rbp, const T* wp, const T* bp, T* so, T* y,
                    S* mean_o, S* rstd_o, int64_t rows, int64_t C, double e) {
  for (int64_t r = 0; r < rows; ++r) {
    T* sp = so + r * C;
    double s = 0;
    for (int64_t i = 0; i < C; ++i) {
      bt::compute_t<T> v = static_cast<bt::compute_t<T>>(xp[r * C + i]) +
                           static_cast<bt::compute_t<T>>(rp[r * C + i]);
      if (rbp) v += static_cast<bt::compute_t<T>>(rbp[i]);
      sp[i] = static_cast<T>(v);
      s += static_cast<double>(sp[i]);
    }
    const double mean = s / static_cast<double>(C);
    double ss = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double d = static_cast<double>(sp[i]) - mean;
      ss += d * d;
    }
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(C) + e);
    mean_o[r] = static_cast<S>(mean);
    rstd_o[r] = static_cast<S>(rstd);
    T* q = y + r * C;
    for (int64_t i = 0; i < C; ++i) {
      double v = (static_cast<double>(sp[i]) - mean) * rstd;
      if (wp) v *= static_cast<double>(wp[i]);
      if (bp) v += static_cast<double>(bp[i]);
      q[i] = static_cast<T>(v);
    }
  }
}

template <typename T, typename S>
void layer_norm_backward(const T* dyp, const T* xp, const T* wp, const S* mp, const S* rp,
                         const T* ep, T* dx, double* dw, double* db, double* ds, int64_t R,
                         int64_t C) {
  for (int64_t r = 0; r < R; ++r) {
    const T* g = dyp + r * C;
    const T* p = xp + r * C;
    const double m = static_cast<double>(mp[r]), rs = static_cast<double>(rp[r]);
    double s1 = 0, s2 = 0;
    for (int64_t i = 0; i < C; ++i) {
      const double gx = static_cast<double>(g[i]) * (wp ? static_cast<double>(wp[i]) : 1.0);
      s1 += gx;
      s2 += gx * (static_cast<double>(p[i]) - m) * rs;
    }
    s1 /= static_cast<double>(C);
    s2 /= static_cast<double>(C);
    T* q = dx + r * C;
    for (int64_t i = 0; i < C; ++i) {
      const double gx = static_cast<double>(g[i]) * (wp ? static_cast<double>(wp[i]) : 1.0);
      const double xh = (static_cast<double>(p[i]) - m) * rs;
      double v = rs * (gx - s1 - xh * s2);
      if (ep) v += static_cast<double>(ep[r * C + i]);
      q[i] = static_cast<T>(v);
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    double sw = 0, sb = 0, sd = 0;
    for (int64_t r = 0; r < R; ++r) {
      const double g = static_cast<double>(dyp[r * C + c]);
      sw += g * (static_cast<double>(xp[r * C + c]) - static_cast<double>(mp[r])) *
            static_cast<double>(rp[r]);
      sb += g;
      sd += static_cast<double>(dx[r * C + c]);
    }
    dw[c] = sw;
    db[c] = sb;
    ds[c] = sd;
  }
}

}  // namespace v1

// ---- harness ---------------------------------------------------------------------------------

double cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double best_ms(int reps, const std::function<void()>& f) {
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

int failures = 0;
int checks = 0;

void report(const char* kernel, const char* dt, int64_t R, int64_t C, bool ok, double t_ref,
            double t_new) {
  ++checks;
  if (!ok) ++failures;
  std::printf("%-22s %-9s %5lld x %-5lld %-8s v1 %8.3f ms  now %8.3f ms  %6.2fx\n", kernel, dt,
              static_cast<long long>(R), static_cast<long long>(C), ok ? "same" : "DIFFERS",
              t_ref, t_new, t_ref / std::max(t_new, 1e-9));
}

template <typename T, typename S>
void check_layer_norm(const char* dt, int64_t R, int64_t C, int reps, std::mt19937_64& g) {
  namespace nk = bt::cpu::norm;
  const auto x = random_rows<T>(R, C, g, true), res = random_rows<T>(R, C, g, false);
  const auto w = random_rows<T>(1, C, g, false), b = random_rows<T>(1, C, g, false);
  const auto dy = random_rows<T>(R, C, g, true), ex = random_rows<T>(R, C, g, false);
  const double eps = 1e-5;
  std::vector<T> y1(x.size()), y2(x.size()), s1(x.size()), s2(x.size());
  std::vector<S> m1(R), m2(R), r1(R), r2(R);
  for (int variant = 0; variant < 4; ++variant) {  // (w, b), w only, b only, neither
    const T* wp = variant == 0 || variant == 1 ? w.data() : nullptr;
    const T* bp = variant == 0 || variant == 2 ? b.data() : nullptr;
    const double ta = best_ms(reps, [&] {
      v1::layer_norm<T, S>(x.data(), wp, bp, y1.data(), m1.data(), r1.data(), R, C, eps);
    });
    const double tb = best_ms(reps, [&] {
      nk::layer_norm_rows<T, S>(x.data(), wp, bp, y2.data(), m2.data(), r2.data(), 0, R, C, eps);
    });
    if (variant == 0 || !same_bits(y1, y2) || !same_bits(m1, m2) || !same_bits(r1, r2))
      report("layer_norm", dt, R, C, same_bits(y1, y2) && same_bits(m1, m2) && same_bits(r1, r2),
             ta, tb);
  }
  for (int variant = 0; variant < 2; ++variant) {  // with and without the residual bias
    const T* rbp = variant == 0 ? b.data() : nullptr;
    const double ta = best_ms(reps, [&] {
      v1::add_layer_norm<T, S>(x.data(), res.data(), rbp, w.data(), b.data(), s1.data(), y1.data(),
                               m1.data(), r1.data(), R, C, eps);
    });
    const double tb = best_ms(reps, [&] {
      nk::add_layer_norm_rows<T, bt::compute_t<T>, S>(x.data(), res.data(), rbp, w.data(),
                                                       b.data(), s2.data(), y2.data(), m2.data(),
                                                       r2.data(), 0, R, C, eps);
    });
    const bool ok = same_bits(s1, s2) && same_bits(y1, y2) && same_bits(m1, m2) &&
                    same_bits(r1, r2);
    if (variant == 0 || !ok) report("add_layer_norm", dt, R, C, ok, ta, tb);
  }
  // backward, from the forward's statistics
  v1::layer_norm<T, S>(x.data(), w.data(), b.data(), y1.data(), m1.data(), r1.data(), R, C, eps);
  std::vector<T> dx1(x.size()), dx2(x.size());
  std::vector<double> a1(3 * C), a2(3 * C);
  for (int variant = 0; variant < 3; ++variant) {  // with w, without w, with an extra gradient
    const T* wp = variant != 1 ? w.data() : nullptr;
    const T* ep = variant == 2 ? ex.data() : nullptr;
    const double ta = best_ms(reps, [&] {
      v1::layer_norm_backward<T, S>(dy.data(), x.data(), wp, m1.data(), r1.data(), ep, dx1.data(),
                                    a1.data(), a1.data() + C, a1.data() + 2 * C, R, C);
    });
    const double tb = best_ms(reps, [&] {
      nk::layer_norm_backward_rows<T, S>(dy.data(), x.data(), wp, m1.data(), r1.data(), ep,
                                         dx2.data(), 0, R, C);
      std::vector<double> acc(3 * nk::kColBlock);
      for (int64_t c0 = 0; c0 < C; c0 += nk::kColBlock) {
        const int64_t n = std::min(C, c0 + nk::kColBlock) - c0;
        nk::layer_norm_column_sums<T, S>(dy.data(), x.data(), m1.data(), r1.data(), dx2.data(), R,
                                         C, c0, n, true, true, true, acc.data(),
                                         acc.data() + nk::kColBlock,
                                         acc.data() + 2 * nk::kColBlock);
        for (int64_t j = 0; j < n; ++j) {
          a2[c0 + j] = acc[j];
          a2[C + c0 + j] = acc[nk::kColBlock + j];
          a2[2 * C + c0 + j] = acc[2 * nk::kColBlock + j];
        }
      }
    });
    const bool ok = same_bits(dx1, dx2) && same_bits(a1, a2);
    if (variant == 0 || !ok) report("layer_norm backward", dt, R, C, ok, ta, tb);
  }
}

int main(int argc, char** argv) {
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
  }
  std::mt19937_64 g(1234);
  const int64_t shapes[][2] = {{1, 1}, {3, 5}, {7, 127}, {64, 128}, {1024, 128},
                               {256, 768}, {2048, 1024}, {64, 3072}};
  for (const auto& s : shapes) {
    check_layer_norm<float, float>("float32", s[0], s[1], reps, g);
    check_layer_norm<double, double>("float64", s[0], s[1], reps, g);
    check_layer_norm<bfloat16, float>("bfloat16", s[0], s[1], reps, g);
    check_layer_norm<float16, float>("float16", s[0], s[1], reps, g);
  }
  std::printf("%d checks, %d differ from v1\n", checks, failures);
  return failures ? 1 : 0;
}
