// cpu/norm_kernels.h: the CPU layer-norm kernels (forward, residual-add forward, backward rows
// and column sums) as plain functions over raw rows, so bench/cpu_kernels_check.cpp can check
// them bit for bit against the reference versions on every instruction set.
//
// Note [lane sums]
// Each row statistic is a double sum over kSumLanes lanes: lane k adds the row's elements k,
// k + kSumLanes, ... in index order, the tail (past the last whole group) goes to lane 0 in
// order, and the lanes are added 0, 1, ... at the end. A fixed order: the bits depend neither
// on the thread count (one thread reduces a row) nor on the instruction set (the lane count is
// not the vector width; no contraction), and the loops vectorise, where one running sum per row
// (the first kernels' order, kept by running 4-8 rows side by side until this change) was a
// chain of scalar adds: 2048 x 1024 float32 on one core, forward 1.8 -> 1.2 ms, backward rows
// 2.5 -> 1.5 ms. The sums differ from the index-order ones in the last bits of a double, so a
// float32 output differs from the earlier kernels' only where it lay within ~1e-16 of a rounding
// boundary. Column sums (dweight, dbias) walk the rows in order for a block of columns at once
// (contiguous, so vectorised). The element-wise passes are vectorised by BT_CPU_CLONES.
// Mixed dtypes (Note [float32 residual stream], nn_fused.h): x, weight, bias and the residual
// sum are T; y, the residual, dy, dx and extra may be 16-bit (O, D) over float32 T rows. Every
// value is widened to double as it is read, so the same code gives the same bits for both.
// Including files must be compiled with -ffp-contract=off: a fused multiply-add rounds once
// where the scalar reference (bench/cpu_kernels_check.cpp, and baseline x86-64) rounds twice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fastmath.h"  // BT_CPU_CLONES

namespace bt::cpu::norm {

constexpr int kSumLanes = 16;        // Note [lane sums]
constexpr int64_t kColBlock = 256;   // columns one column-sum task owns (8 KB of doubles a sum)

inline double add_lanes(const double* a) {
  double r = 0;
  for (int k = 0; k < kSumLanes; ++k) r += a[k];
  return r;
}

// ---- layer_norm forward ----------------------------------------------------------------------
// mean = sum(x) / C; rstd = 1 / sqrt(sum((x - mean)^2) / C + eps); lane sums in double.
template <typename T>
BT_CPU_CLONES void row_stats(const T* p, int64_t C, double eps, double* mean, double* rstd) {
  const int64_t full = C / kSumLanes * kSumLanes;
  double s[kSumLanes] = {};
  for (int64_t i = 0; i < full; i += kSumLanes) {
    for (int k = 0; k < kSumLanes; ++k) s[k] += static_cast<double>(p[i + k]);
  }
  for (int64_t i = full; i < C; ++i) s[0] += static_cast<double>(p[i]);
  const double m = add_lanes(s) / static_cast<double>(C);
  double ss[kSumLanes] = {};
  for (int64_t i = 0; i < full; i += kSumLanes) {
    for (int k = 0; k < kSumLanes; ++k) {
      const double d = static_cast<double>(p[i + k]) - m;
      ss[k] += d * d;
    }
  }
  for (int64_t i = full; i < C; ++i) {
    const double d = static_cast<double>(p[i]) - m;
    ss[0] += d * d;
  }
  *mean = m;
  *rstd = 1.0 / std::sqrt(add_lanes(ss) / static_cast<double>(C) + eps);
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
  for (int64_t r = r0; r < r1; ++r) {
    double mean, rstd;
    row_stats(x + r * C, C, eps, &mean, &rstd);
    mean_o[r] = static_cast<S>(mean);
    rstd_o[r] = static_cast<S>(rstd);
    normalize(x + r * C, w, b, y + r * C, C, mean, rstd);
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
template <bool W, typename D, typename T>
BT_CPU_CLONES void backward_sums(const D* g, const T* p, const T* w, double m, double rs, int64_t C,
                                 double* s1, double* s2) {
  const int64_t full = C / kSumLanes * kSumLanes;
  double a[kSumLanes] = {}, c[kSumLanes] = {};
  auto term = [&](int64_t i, double& ak, double& ck) {
    const double gx = static_cast<double>(g[i]) * (W ? static_cast<double>(w[i]) : 1.0);
    ak += gx;
    ck += gx * (static_cast<double>(p[i]) - m) * rs;
  };
  for (int64_t i = 0; i < full; i += kSumLanes) {
    for (int k = 0; k < kSumLanes; ++k) term(i + k, a[k], c[k]);
  }
  for (int64_t i = full; i < C; ++i) term(i, a[0], c[0]);
  *s1 = add_lanes(a) / static_cast<double>(C);
  *s2 = add_lanes(c) / static_cast<double>(C);
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
  for (int64_t r = r0; r < r1; ++r) {
    const double m = static_cast<double>(mp[r]), rs = static_cast<double>(rp[r]);
    const int64_t o = r * C;
    double s1, s2;
    backward_sums<W>(dy + o, x + o, w, m, rs, C, &s1, &s2);
    if (ex) {
      dx_row<W, true>(dy + o, x + o, w, ex + o, dx + o, C, m, rs, s1, s2);
    } else {
      dx_row<W, false>(dy + o, x + o, w, ex, dx + o, C, m, rs, s1, s2);
    }
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
// kColRows rows a pass over the block's accumulators (each column still adds its rows in order,
// so the same bits): the accumulators' loads and stores, not the arithmetic, bounded one row a
// pass.
constexpr int kColRows = 4;

template <bool DW, bool DB, bool DS, typename D, typename T, typename S, typename O>
BT_CPU_CLONES void column_sums_block(const D* dy, const T* x, const S* mp, const S* rp,
                                     const O* dx, int64_t R, int64_t C, int64_t c0, int64_t n,
                                     double* sw, double* sb, double* sd) {
  for (int64_t j = 0; j < n; ++j) {
    sw[j] = 0;
    sb[j] = 0;
    sd[j] = 0;
  }
  int64_t r = 0;
  for (; r + kColRows <= R; r += kColRows) {
    const D* g[kColRows];
    const T* p[kColRows];
    const O* d[kColRows];
    double m[kColRows], rs[kColRows];
    for (int k = 0; k < kColRows; ++k) {
      g[k] = dy + (r + k) * C + c0;
      p[k] = x + (r + k) * C + c0;
      d[k] = dx + (r + k) * C + c0;
      m[k] = static_cast<double>(mp[r + k]);
      rs[k] = static_cast<double>(rp[r + k]);
    }
    for (int64_t j = 0; j < n; ++j) {
      double aw = sw[j], ab = sb[j], ad = sd[j];
      for (int k = 0; k < kColRows; ++k) {
        const double gv = static_cast<double>(g[k][j]);
        if constexpr (DW) aw += gv * (static_cast<double>(p[k][j]) - m[k]) * rs[k];
        if constexpr (DB) ab += gv;
        if constexpr (DS) ad += static_cast<double>(d[k][j]);
      }
      sw[j] = aw;
      sb[j] = ab;
      sd[j] = ad;
    }
  }
  for (; r < R; ++r) {
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
