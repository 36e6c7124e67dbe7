// bench/cpu_kernels_check.cpp: the CPU row kernels against their first versions, bit for bit,
// and timed (llm.c's dev/ habit: v1 is the reference, production keeps the winner).
//
//   bash bench/cpu_kernels_check.sh      # builds this once per instruction set and runs each
//
// v1 (below) is the scalar code each kernel replaced, kept verbatim in its arithmetic but for
// the changes marked v2 (row sums in 16 lanes, float exp in the log_softmax / CE backward) and v3
// (layer norm: float32 y in float, the backward column sums in blocks of rows). The
// production kernels (src/cpu/norm_kernels.h) must give the same bits on every instruction set:
// this file is built with BT_CPU_CLONES empty and -march=x86-64-v4, -v3 and the baseline in
// turn (what target_clones picks at load time on such machines), -ffp-contract=off as
// CMakeLists.txt compiles those kernels. Inputs: random rows of several widths, plus rows of
// equal values, huge and tiny magnitudes, zeros, and a NaN and an infinity. Times are the
// calling thread's CPU time (best of --reps), so a busy machine inflates them less than wall
// time would.
#include "cpu_kernels_check.h"

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
#include <type_traits>
#include <vector>

#include "../src/cpu/gelu_kernels.h"
#include "../src/cpu/norm_kernels.h"
#include "../src/cpu/softmax_kernels.h"
#include "../src/dtype.h"

using bt::bfloat16;
using bt::float16;

namespace v1 {  // the first CPU kernels (row by row), their row sums since v2 in lanes

// v2's row sums (Note [lane sums] in norm_kernels.h): sum of f(i), i in [0, C), over 16 lanes
// (v1: one running sum in index order).
template <typename F>
double lane_sum(int64_t C, F f) {
  constexpr int L = 16;
  double a[L] = {};
  const int64_t full = C / L * L;
  for (int64_t i = 0; i < full; i += L) {
    for (int k = 0; k < L; ++k) a[k] += f(i + k);
  }
  for (int64_t i = full; i < C; ++i) a[0] += f(i);
  double r = 0;
  for (int k = 0; k < L; ++k) r += a[k];
  return r;
}

// y of a row: v1 in double for every dtype; v3 (Note [float normalize] in norm_kernels.h) in
// float for float32 rows, the mean as hi + lo floats.
template <typename T>
void normalize_ref(const T* p, const T* wp, const T* bp, T* q, int64_t C, double mean,
                   double rstd) {
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = 0; i < C; ++i) {
      double v = (static_cast<double>(p[i]) - mean) * rstd;
      if (wp) v *= static_cast<double>(wp[i]);
      if (bp) v += static_cast<double>(bp[i]);
      q[i] = static_cast<T>(v);
    }
    return;
  }
  const float hi = static_cast<float>(mean), lo = static_cast<float>(mean - hi);
  const float rs = static_cast<float>(rstd);
  for (int64_t i = 0; i < C; ++i) {
    float v = static_cast<float>(p[i]) - hi;
    v = v - lo;
    v = v * rs;
    if (wp) v = v * static_cast<float>(wp[i]);
    if (bp) v = v + static_cast<float>(bp[i]);
    q[i] = static_cast<T>(v);
  }
}

template <typename T, typename S>
void layer_norm(const T* xp, const T* wp, const T* bp, T* y, S* mean_o, S* rstd_o, int64_t rows,
                int64_t C, double e) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = xp + r * C;
    const double s = lane_sum(C, [&](int64_t i) { return static_cast<double>(p[i]); });
    const double mean = s / static_cast<double>(C);
    const double ss = lane_sum(C, [&](int64_t i) {
      const double d = static_cast<double>(p[i]) - mean;
      return d * d;
    });
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(C) + e);
    mean_o[r] = static_cast<S>(mean);
    rstd_o[r] = static_cast<S>(rstd);
    normalize_ref(p, wp, bp, y + r * C, C, mean, rstd);
  }
}

template <typename T, typename S>
void add_layer_norm(const T* xp, const T* rp, const T* rbp, const T* wp, const T* bp, T* so, T* y,
                    S* mean_o, S* rstd_o, int64_t rows, int64_t C, double e) {
  for (int64_t r = 0; r < rows; ++r) {
    T* sp = so + r * C;
    for (int64_t i = 0; i < C; ++i) {
      bt::compute_t<T> v = static_cast<bt::compute_t<T>>(xp[r * C + i]) +
                           static_cast<bt::compute_t<T>>(rp[r * C + i]);
      if (rbp) v += static_cast<bt::compute_t<T>>(rbp[i]);
      sp[i] = static_cast<T>(v);
    }
    const double s = lane_sum(C, [&](int64_t i) { return static_cast<double>(sp[i]); });
    const double mean = s / static_cast<double>(C);
    const double ss = lane_sum(C, [&](int64_t i) {
      const double d = static_cast<double>(sp[i]) - mean;
      return d * d;
    });
    const double rstd = 1.0 / std::sqrt(ss / static_cast<double>(C) + e);
    mean_o[r] = static_cast<S>(mean);
    rstd_o[r] = static_cast<S>(rstd);
    normalize_ref(sp, wp, bp, y + r * C, C, mean, rstd);
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
    auto gx = [&](int64_t i) {
      return static_cast<double>(g[i]) * (wp ? static_cast<double>(wp[i]) : 1.0);
    };
    const double s1 = lane_sum(C, gx) / static_cast<double>(C);
    const double s2 =
        lane_sum(C, [&](int64_t i) { return gx(i) * (static_cast<double>(p[i]) - m) * rs; }) /
        static_cast<double>(C);
    T* q = dx + r * C;
    for (int64_t i = 0; i < C; ++i) {
      const double gx = static_cast<double>(g[i]) * (wp ? static_cast<double>(wp[i]) : 1.0);
      const double xh = (static_cast<double>(p[i]) - m) * rs;
      double v = rs * (gx - s1 - xh * s2);
      if (ep) v += static_cast<double>(ep[r * C + i]);
      q[i] = static_cast<T>(v);
    }
  }
  // v3 (Note [column blocks] in norm_kernels.h): each block of block_rows(R) rows sums its rows
  // in order from 0, the block sums are added in block order from 0; dweight's term is
  // dy * ((x - mean) * rstd) (v1: one chain per column down all rows, (dy * (x - mean)) * rstd).
  const int64_t br = std::max<int64_t>(32, (R + 63) / 64);
  for (int64_t c = 0; c < C; ++c) {
    double sw = 0, sb = 0, sd = 0;
    for (int64_t r0 = 0; r0 < R; r0 += br) {
      double bw = 0, bb = 0, bd = 0;
      for (int64_t r = r0; r < std::min(R, r0 + br); ++r) {
        const double g = static_cast<double>(dyp[r * C + c]);
        bw += g * ((static_cast<double>(xp[r * C + c]) - static_cast<double>(mp[r])) *
                   static_cast<double>(rp[r]));
        bb += g;
        bd += static_cast<double>(dx[r * C + c]);
      }
      sw += bw;
      sb += bb;
      sd += bd;
    }
    dw[c] = sw;
    db[c] = sb;
    ds[c] = sd;
  }
}

template <typename T>
void softmax_backward(const T* yp, const T* gp, T* o, int64_t rows, int64_t C, bool lg) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* a = yp + r * C;
    const T* g = gp + r * C;
    T* q = o + r * C;
    const double s = lane_sum(C, [&](int64_t i) {
      return lg ? static_cast<double>(g[i]) : static_cast<double>(g[i]) * static_cast<double>(a[i]);
    });
    for (int64_t i = 0; i < C; ++i) {
      const double yv = static_cast<double>(a[i]), gv = static_cast<double>(g[i]);
      // v2: exp(y) in the compute type (float's fast_exp for 16/32-bit rows); v1 used libm's
      // double exp, about 10x slower than the vectorised float one
      using A = bt::compute_t<T>;
      const double e = static_cast<double>(bt::cpu::softmax::exp_c(static_cast<A>(a[i])));
      q[i] = static_cast<T>(lg ? gv - e * s : yv * (gv - s));
    }
  }
}

// cross_entropy's dlogits rows (v2 arithmetic: exp of (x - lse) rounded to the compute type).
template <typename T>
void ce_backward(const T* xp, T* o, int64_t rows, int64_t C, const double* lse, const int64_t* tgt,
                 double scale, double ls) {
  using A = bt::compute_t<T>;
  const double off = ls / static_cast<double>(C);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < C; ++i) {
      const double t = static_cast<double>(xp[r * C + i]) - lse[r];
      double d = static_cast<double>(bt::cpu::softmax::exp_c(static_cast<A>(t))) - off;
      if (i == tgt[r]) d -= 1.0 - ls;
      o[r * C + i] = static_cast<T>(d * scale);
    }
  }
}

// dy * gelu_tanh'(x) as the composed ops computed it: one op a pass, each rounded to T.
template <typename T>
void gelu_tanh_backward(const T* x, const T* g, T* out, int64_t n,
                        void (*tanh_fn)(const T*, T*, int64_t)) {
  using C = bt::compute_t<T>;
  auto K = [](double v) { return static_cast<C>(static_cast<T>(static_cast<C>(v))); };
  auto op = [&](std::vector<T>& o, auto f) {
    o.resize(n);
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(f(i));
  };
  const double k = std::sqrt(2.0 / M_PI), c = 0.044715;
  std::vector<T> x2, a, b, u1, u, t, l1, left, tt, om, p1, d1, e1, p2, right, s;
  op(x2, [&](int64_t i) { return C(x[i]) * C(x[i]); });
  op(a, [&](int64_t i) { return C(x2[i]) * K(c); });
  op(b, [&](int64_t i) { return C(a[i]) + K(1.0); });
  op(u1, [&](int64_t i) { return C(x[i]) * C(b[i]); });
  op(u, [&](int64_t i) { return C(u1[i]) * K(k); });
  t.resize(n);
  tanh_fn(u.data(), t.data(), n);
  op(l1, [&](int64_t i) { return C(t[i]) + K(1.0); });
  op(left, [&](int64_t i) { return C(l1[i]) * K(0.5); });
  op(tt, [&](int64_t i) { return C(t[i]) * C(t[i]); });
  op(om, [&](int64_t i) { return K(1.0) - C(tt[i]); });
  op(p1, [&](int64_t i) { return C(x[i]) * C(om[i]); });
  op(d1, [&](int64_t i) { return C(x2[i]) * K(3 * c); });
  op(e1, [&](int64_t i) { return C(d1[i]) + K(1.0); });
  op(p2, [&](int64_t i) { return C(p1[i]) * C(e1[i]); });
  op(right, [&](int64_t i) { return C(p2[i]) * K(0.5 * k); });
  op(s, [&](int64_t i) { return C(left[i]) + C(right[i]); });
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(C(g[i]) * C(s[i]));
}

}  // namespace v1

// ---- harness ---------------------------------------------------------------------------------

int failures = 0;
int checks = 0;

void report(const char* kernel, const char* dt, int64_t R, int64_t C, bool ok, double t_ref,
            double t_new) {
  ++checks;
  if (!ok) ++failures;
  std::printf("%-22s %-9s %5lld x %-5lld %-8s v1 %8.3f ms  now %8.3f ms  %6.2fx\n", kernel, dt,
              static_cast<long long>(R), static_cast<long long>(C), ok ? "same" : "DIFFERS", t_ref,
              t_new, t_ref / std::max(t_new, 1e-9));
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
      nk::add_layer_norm_rows<T, bt::compute_t<T>, S>(x.data(), res.data(), rbp, w.data(), b.data(),
                                                      s2.data(), y2.data(), m2.data(), r2.data(), 0,
                                                      R, C, eps);
    });
    const bool ok =
        same_bits(s1, s2) && same_bits(y1, y2) && same_bits(m1, m2) && same_bits(r1, r2);
    if (variant == 0 || !ok) report("add_layer_norm", dt, R, C, ok, ta, tb);
  }
  // backward, from the forward's statistics
  v1::layer_norm<T, S>(x.data(), w.data(), b.data(), y1.data(), m1.data(), r1.data(), R, C, eps);
  std::vector<T> dx1(x.size()), dx2(x.size());
  std::vector<double> a1(3 * C), a2(3 * C);
  for (int variant = 0; variant < 3; ++variant) {  // with w, without w, with an extra gradient
    const T* wp = variant != 1 ? w.data() : nullptr;
    const T* ep = variant == 2 ? ex.data() : nullptr;
    std::vector<double> wide(w.size());  // the kernels take the weight widened to double
    for (size_t i = 0; i < w.size(); ++i) wide[i] = static_cast<double>(w[i]);
    const double* wdp = wp ? wide.data() : nullptr;
    const double ta = best_ms(reps, [&] {
      v1::layer_norm_backward<T, S>(dy.data(), x.data(), wp, m1.data(), r1.data(), ep, dx1.data(),
                                    a1.data(), a1.data() + C, a1.data() + 2 * C, R, C);
    });
    const double tb = best_ms(reps, [&] {
      const int64_t br = nk::block_rows(R), nblk = (R + br - 1) / br;
      std::vector<double> part(static_cast<size_t>(nblk * 3 * C));
      for (int64_t b = 0; b < nblk; ++b) {
        double* p = part.data() + b * 3 * C;
        nk::layer_norm_backward_block<T, S>(dy.data(), x.data(), wdp, m1.data(), r1.data(), ep,
                                            dx2.data(), b * br, std::min(R, (b + 1) * br), C, true,
                                            true, p, p + C, p + 2 * C);
      }
      for (int s = 0; s < 3; ++s)
        nk::add_partials(part.data() + s * C, nblk, 3 * C, 0, C, a2.data() + s * C);
    });
    // dx alone (no column sums asked for): the row kernel, the same dx
    std::vector<T> dx3(x.size());
    nk::layer_norm_backward_rows<T, S>(dy.data(), x.data(), wdp, m1.data(), r1.data(), ep,
                                       dx3.data(), 0, R, C);
    const bool ok = same_bits(dx1, dx2) && same_bits(a1, a2) && same_bits(dx1, dx3);
    if (variant == 0 || !ok) report("layer_norm backward", dt, R, C, ok, ta, tb);
  }
}

template <typename T>
void check_softmax_backward(const char* dt, int64_t R, int64_t C, int reps, std::mt19937_64& g) {
  auto y = random_rows<T>(R, C, g, true);
  for (auto& v : y) v = static_cast<T>(std::fabs(static_cast<double>(v)) * 0.01);  // like probs
  const auto dy = random_rows<T>(R, C, g, true);
  std::vector<T> a(y.size()), b(y.size());
  for (bool lg : {false, true}) {
    const double ta =
        best_ms(reps, [&] { v1::softmax_backward<T>(y.data(), dy.data(), a.data(), R, C, lg); });
    const double tb = best_ms(reps, [&] {
      bt::cpu::softmax::backward_rows<T>(y.data(), dy.data(), b.data(), 0, R, C, lg);
    });
    report(lg ? "log_softmax backward" : "softmax backward", dt, R, C, same_bits(a, b), ta, tb);
  }
  // cross_entropy's gradient rows, out of place and over the logits (b starts as a copy of x)
  auto x = random_rows<T>(R, C, g, true);
  std::vector<double> lse(R);
  std::vector<int64_t> tgt(R);
  for (int64_t r = 0; r < R; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t i = 0; i < C; ++i) m = std::max(m, static_cast<double>(x[r * C + i]));
    for (int64_t i = 0; i < C; ++i) s += std::exp(static_cast<double>(x[r * C + i]) - m);
    lse[r] = m + std::log(s);
    tgt[r] = static_cast<int64_t>(g() % static_cast<uint64_t>(C));
  }
  for (double ls : {0.0, 0.1}) {
    const double ta = best_ms(reps, [&] {
      v1::ce_backward<T>(x.data(), a.data(), R, C, lse.data(), tgt.data(), 0.5, ls);
    });
    const double tb = best_ms(reps, [&] {
      for (int64_t r = 0; r < R; ++r) {
        bt::cpu::softmax::ce_grad_row<T>(x.data() + r * C, b.data() + r * C, C, C, lse[r], 0.5,
                                         ls / static_cast<double>(C), ls, tgt[r]);
      }
    });
    bool ok = same_bits(a, b);
    b = x;  // in place
    for (int64_t r = 0; r < R; ++r) {
      bt::cpu::softmax::ce_grad_row<T>(b.data() + r * C, b.data() + r * C, C, C, lse[r], 0.5,
                                       ls / static_cast<double>(C), ls, tgt[r]);
    }
    ok = ok && same_bits(a, b);
    report(ls == 0 ? "ce backward" : "ce backward (ls 0.1)", dt, R, C, ok, ta, tb);
  }
}

// The Tanh op's loop, as elementwise.cpp compiles it (its own clone there: FMA contraction on),
// comes from cpu_kernels_check_fwd.cpp; here only the passes around it are under test.
template <typename T>
void check_gelu_backward(const char* dt, int64_t n, int reps, std::mt19937_64& g) {
  auto x = random_rows<T>(1, n, g, false);
  for (auto& v : x) v = static_cast<T>(static_cast<double>(v) * 2);
  if (n > 4) {
    x[0] = static_cast<T>(0.0);
    x[1] = static_cast<T>(30.0);
    x[2] = static_cast<T>(-30.0);
    x[3] = static_cast<T>(std::numeric_limits<double>::infinity());
    x[4] = static_cast<T>(std::numeric_limits<double>::quiet_NaN());
  }
  const auto dy = random_rows<T>(1, n, g, false);
  std::vector<T> a(n), b(n);
  void (*tanh_fn)(const T*, T*, int64_t) = &tanh_loop<T>;
  const double ta =
      best_ms(reps, [&] { v1::gelu_tanh_backward<T>(x.data(), dy.data(), a.data(), n, tanh_fn); });
  const double tb = best_ms(reps, [&] {
    const bt::cpu::gelu::Consts<T> q;
    T u[512], t[512];
    for (int64_t i = 0; i < n; i += 512) {
      const int64_t m = std::min<int64_t>(512, n - i);
      bt::cpu::gelu::backward_pre<T>(x.data() + i, u, m, q);
      tanh_fn(u, t, m);
      bt::cpu::gelu::backward_post<T>(x.data() + i, t, dy.data() + i, b.data() + i, m, q);
    }
  });
  report("gelu_tanh backward", dt, 1, n, same_bits(a, b), ta, tb);
}

int main(int argc, char** argv) {
  int reps = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
  }
  std::mt19937_64 g(1234);
  const int64_t shapes[][2] = {{1, 1},      {3, 5},     {7, 127},     {64, 128},
                               {1024, 128}, {256, 768}, {2048, 1024}, {64, 3072}};
  for (const auto& s : shapes) {
    check_layer_norm<float, float>("float32", s[0], s[1], reps, g);
    check_layer_norm<double, double>("float64", s[0], s[1], reps, g);
    check_layer_norm<bfloat16, float>("bfloat16", s[0], s[1], reps, g);
    check_layer_norm<float16, float>("float16", s[0], s[1], reps, g);
  }
  for (const auto& s : shapes) {
    check_softmax_backward<float>("float32", s[0], s[1], reps, g);
    check_softmax_backward<double>("float64", s[0], s[1], reps, g);
    check_softmax_backward<bfloat16>("bfloat16", s[0], s[1], reps, g);
  }
  for (int64_t n : {1, 5, 600, 1 << 20}) {
    check_gelu_backward<float>("float32", n, reps, g);
    check_gelu_backward<double>("float64", n, reps, g);
    check_gelu_backward<bfloat16>("bfloat16", n, reps, g);
    check_gelu_backward<float16>("float16", n, reps, g);
  }
  check_softmax_forward(reps);
  std::printf("%d checks, %d differ from v1\n", checks, failures);
  return failures ? 1 : 0;
}
