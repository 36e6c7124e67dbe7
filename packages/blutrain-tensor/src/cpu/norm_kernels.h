// cpu/norm_kernels.h: the CPU layer-norm kernels (forward, residual-add forward, backward rows
// and column sums) as plain functions over raw rows, so bench/cpu_kernels_check.cpp can check
// them bit for bit against the reference versions on every instruction set.
//
// Note [same bits, faster rows]
// Each statistic is a double sum taken element by element in index order (what the first,
// scalar kernels did), and every result must keep those bits. A sum over one row is a chain of
// dependent adds (4 cycles each), so these kernels run several rows side by side: their
// chains are independent and overlap, each one in its own order. Column sums (dweight, dbias)
// walk the rows in order for a block of columns at once (contiguous, so vectorised), instead
// of one column down the rows. The element-wise passes are vectorised by BT_CPU_CLONES.
// Mixed dtypes (Note [float32 residual stream], nn_fused.h): x, weight, bias and the residual
// sum are T; y, the residual, dy, dx and extra may be 16-bit (O, D) over float32 T rows. Every
// value is widened to double as it is read, so the same code gives the same bits for both.
// Including files must be compiled with -ffp-contract=off: a fused multiply-add rounds once
// where the reference (baseline x86-64, which has no FMA) rounded twice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fastmath.h"  // BT_CPU_CLONES

namespace bt::cpu::norm {

// Rows whose sums overlap: 8 chains keep both FP add pipes busy; the backward reads two rows a
// row (dy, x), so 4 keep its working set in L1 (8 was slower on 4 KB rows).
constexpr int kRowsInFlight = 8;
constexpr int kRowsInFlightBackward = 4;
constexpr int64_t kColBlock = 256;   // columns one column-sum task owns (8 KB of doubles a sum)

// ---- layer_norm forward ----------------------------------------------------------------------
// mean = sum(x) / C; rstd = 1 / sqrt(sum((x - mean)^2) / C + eps); sums in double, in order.
template <int K, typename T>
inline void row_stats(const T* const* p, int64_t C, double eps, double* mean, double* rstd) {
  double s[K], ss[K];
  for (int k = 0; k < K; ++k) s[k] = 0;
  for (int64_t i = 0; i < C; ++i) {
    for (int k = 0; k < K; ++k) s[k] += static_cast<double>(p[k][i]);
  }
  for (int k = 0; k < K; ++k) {
    mean[k] = s[k] / static_cast<double>(C);
    ss[k] = 0;
  }
  for (int64_t i = 0; i < C; ++i) {
    for (int k = 0; k < K; ++k) {
      const double d = static_cast<double>(p[k][i]) - mean[k];
      ss[k] += d * d;
    }
  }
  for (int k = 0; k < K; ++k) rstd[k] = 1.0 / std::sqrt(ss[k] / static_cast<double>(C) + eps);
}

// y = (x - mean) * rstd [* w] [+ b], in double, rounded once to O.
template <bool W, bool B, typename T, typename O>
BT_CPU_CLONES void normalize_row(const T* p, const T* w, const T* b, O* q, int64_t C, double mean,
                                 double rstd) {
  for (int64_t i = 0; i < C; ++i) {
    double v = (static_cast<double>(p[i]) - mean) * rstd;
    if constexpr (W) v *= static_cast<double>(w[i]);
    if constexpr (B) v += static_cast<double>(b[i]);
    q[i] = static_cast<O>(v);
  }
}

template <typename T, typename O>
inline void normalize(const T* p, const T* w, const T* b, O* q, int64_t C, double mean,
                      double rstd) {
  if (w && b) {
    normalize_row<true, true>(p, w, b, q, C, mean, rstd);
  } else if (w) {
    normalize_row<true, false>(p, w, b, q, C, mean, rstd);
  } else if (b) {
    normalize_row<false, true>(p, w, b, q, C, mean, rstd);
  } else {
    normalize_row<false, false>(p, w, b, q, C, mean, rstd);
  }
}

// Rows [r0, r1) of x (R, C) contiguous: y (O: T, or 16-bit over float32 x), mean, rstd.
template <typename T, typename S, typename O>
void layer_norm_rows(const T* x, const T* w, const T* b, O* y, S* mean_o, S* rstd_o, int64_t r0,
                     int64_t r1, int64_t C, double eps) {
  auto finish = [&](int64_t r, double mean, double rstd) {
    mean_o[r] = static_cast<S>(mean);
    rstd_o[r] = static_cast<S>(rstd);
    normalize(x + r * C, w, b, y + r * C, C, mean, rstd);
  };
  int64_t r = r0;
  for (; r + kRowsInFlight <= r1; r += kRowsInFlight) {
    const T* p[kRowsInFlight];
    double mean[kRowsInFlight], rstd[kRowsInFlight];
    for (int k = 0; k < kRowsInFlight; ++k) p[k] = x + (r + k) * C;
    row_stats<kRowsInFlight>(p, C, eps, mean, rstd);
    for (int k = 0; k < kRowsInFlight; ++k) finish(r + k, mean[k], rstd[k]);
  }
  for (; r < r1; ++r) {
    const T* p[1] = {x + r * C};
    double mean[1], rstd[1];
    row_stats<1>(p, C, eps, mean, rstd);
    finish(r, mean[0], rstd[0]);
  }
}

// ---- add + layer_norm forward ------------------------------------------------------------------
// s = x + residual [+ residual_bias] in the compute type Cm, rounded to T once; the norm of s.
// The residual (and y) are O: T, or 16-bit over float32 x.
template <typename T, typename Cm, typename O>
BT_CPU_CLONES void add_rows(const T* x, const O* res, const T* rb, T* s, int64_t C) {
  if (rb) {
    for (int64_t i = 0; i < C; ++i) {
      Cm v = static_cast<Cm>(x[i]) + static_cast<Cm>(res[i]);
      v += static_cast<Cm>(rb[i]);
      s[i] = static_cast<T>(v);
    }
  } else {
    for (int64_t i = 0; i < C; ++i) s[i] = static_cast<T>(static_cast<Cm>(x[i]) + static_cast<Cm>(res[i]));
  }
}

template <typename T, typename Cm, typename S, typename O>
void add_layer_norm_rows(const T* x, const O* res, const T* rb, const T* w, const T* b, T* sum,
                         O* y, S* mean_o, S* rstd_o, int64_t r0, int64_t r1, int64_t C,
                         double eps) {
  for (int64_t r = r0; r < r1; ++r) add_rows<T, Cm>(x + r * C, res + r * C, rb, sum + r * C, C);
  layer_norm_rows<T, S>(sum, w, b, y, mean_o, rstd_o, r0, r1, C, eps);
}

// ---- layer_norm backward: dx rows --------------------------------------------------------------
// gx = dy [* w]; s1 = mean(gx); s2 = mean(gx * (x - mean) * rstd);
// dx = rstd * (gx - s1 - xhat * s2) [+ extra], all in double. dy D and dx / extra O: T, or
// 16-bit over float32 x.
template <int K, bool W, typename D, typename T, typename S>
inline void backward_sums(const D* const* g, const T* const* p, const T* w, const S* mp,
                          const S* rp, int64_t C, double* s1, double* s2) {
  double a[K], c[K], m[K], rs[K];
  for (int k = 0; k < K; ++k) {
    a[k] = 0;
    c[k] = 0;
    m[k] = static_cast<double>(mp[k]);
    rs[k] = static_cast<double>(rp[k]);
  }
  for (int64_t i = 0; i < C; ++i) {
    for (int k = 0; k < K; ++k) {
      const double gx = static_cast<double>(g[k][i]) * (W ? static_cast<double>(w[i]) : 1.0);
      a[k] += gx;
      c[k] += gx * (static_cast<double>(p[k][i]) - m[k]) * rs[k];
    }
  }
  for (int k = 0; k < K; ++k) {
    s1[k] = a[k] / static_cast<double>(C);
    s2[k] = c[k] / static_cast<double>(C);
  }
}

template <bool W, bool E, typename D, typename T, typename O>
BT_CPU_CLONES void dx_row(const D* g, const T* p, const T* w, const O* e, O* q, int64_t C,
                          double m, double rs, double s1, double s2) {
  for (int64_t i = 0; i < C; ++i) {
    const double gx = static_cast<double>(g[i]) * (W ? static_cast<double>(w[i]) : 1.0);
    const double xh = (static_cast<double>(p[i]) - m) * rs;
    double v = rs * (gx - s1 - xh * s2);
    if constexpr (E) v += static_cast<double>(e[i]);
    q[i] = static_cast<O>(v);
  }
}

template <bool W, typename D, typename T, typename S, typename O>
void backward_rows_w(const D* dy, const T* x, const T* w, const S* mp, const S* rp, const O* ex,
                     O* dx, int64_t r0, int64_t r1, int64_t C) {
  auto finish = [&](int64_t r, double s1, double s2) {
    const double m = static_cast<double>(mp[r]), rs = static_cast<double>(rp[r]);
    const int64_t o = r * C;
    if (ex) {
      dx_row<W, true>(dy + o, x + o, w, ex + o, dx + o, C, m, rs, s1, s2);
    } else {
      dx_row<W, false>(dy + o, x + o, w, ex, dx + o, C, m, rs, s1, s2);
    }
  };
  int64_t r = r0;
  for (; r + kRowsInFlightBackward <= r1; r += kRowsInFlightBackward) {
    const D* g[kRowsInFlightBackward];
    const T* p[kRowsInFlightBackward];
    double s1[kRowsInFlightBackward], s2[kRowsInFlightBackward];
    for (int k = 0; k < kRowsInFlightBackward; ++k) {
      g[k] = dy + (r + k) * C;
      p[k] = x + (r + k) * C;
    }
    backward_sums<kRowsInFlightBackward, W>(g, p, w, mp + r, rp + r, C, s1, s2);
    for (int k = 0; k < kRowsInFlightBackward; ++k) finish(r + k, s1[k], s2[k]);
  }
  for (; r < r1; ++r) {
    const D* g[1] = {dy + r * C};
    const T* p[1] = {x + r * C};
    double s1[1], s2[1];
    backward_sums<1, W>(g, p, w, mp + r, rp + r, C, s1, s2);
    finish(r, s1[0], s2[0]);
  }
}

// Rows [r0, r1) of dx (R, C); ex (optional): a gradient added to dx (add_layer_norm's residual).
template <typename T, typename S, typename D, typename O>
void layer_norm_backward_rows(const D* dy, const T* x, const T* w, const S* mp, const S* rp,
                              const O* ex, O* dx, int64_t r0, int64_t r1, int64_t C) {
  if (w) {
    backward_rows_w<true>(dy, x, w, mp, rp, ex, dx, r0, r1, C);
  } else {
    backward_rows_w<false>(dy, x, w, mp, rp, ex, dx, r0, r1, C);
  }
}

// ---- layer_norm backward: column sums ----------------------------------------------------------
// Over all R rows, in row order, for columns [c0, c1) (at most kColBlock):
//   sw[c] = sum dy * (x - mean) * rstd,  sb[c] = sum dy,  sd[c] = sum dx (as stored).
template <bool DW, bool DB, bool DS, typename D, typename T, typename S, typename O>
BT_CPU_CLONES void column_sums_block(const D* dy, const T* x, const S* mp, const S* rp,
                                     const O* dx, int64_t R, int64_t C, int64_t c0, int64_t n,
                                     double* sw, double* sb, double* sd) {
  for (int64_t j = 0; j < n; ++j) {
    sw[j] = 0;
    sb[j] = 0;
    sd[j] = 0;
  }
  for (int64_t r = 0; r < R; ++r) {
    const D* g = dy + r * C + c0;
    const T* p = x + r * C + c0;
    const O* d = dx + r * C + c0;
    const double m = static_cast<double>(mp[r]), rs = static_cast<double>(rp[r]);
    for (int64_t j = 0; j < n; ++j) {
      const double gv = static_cast<double>(g[j]);
      if constexpr (DW) sw[j] += gv * (static_cast<double>(p[j]) - m) * rs;
      if constexpr (DB) sb[j] += gv;
      if constexpr (DS) sd[j] += static_cast<double>(d[j]);
    }
  }
}

template <typename T, typename S, typename D, typename O>
void layer_norm_column_sums(const D* dy, const T* x, const S* mp, const S* rp, const O* dx,
                            int64_t R, int64_t C, int64_t c0, int64_t n, bool dw, bool db,
                            bool ds, double* sw, double* sb, double* sd) {
#define BT_COLS(A, B, D) \
  column_sums_block<A, B, D>(dy, x, mp, rp, dx, R, C, c0, n, sw, sb, sd)
  if (dw && db && ds) {
    BT_COLS(true, true, true);
  } else if (dw && db) {
    BT_COLS(true, true, false);
  } else if (dw && ds) {
    BT_COLS(true, false, true);
  } else if (db && ds) {
    BT_COLS(false, true, true);
  } else if (dw) {
    BT_COLS(true, false, false);
  } else if (db) {
    BT_COLS(false, true, false);
  } else {
    BT_COLS(false, false, true);
  }
#undef BT_COLS
}

}  // namespace bt::cpu::norm
