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
// boundary. Column sums (dweight, dbias, dsum): Note [column blocks]. The element-wise passes are
// vectorised by BT_CPU_CLONES. Mixed dtypes (Note [float32 residual stream], nn_fused.h): x,
// weight, bias and the residual sum are T; y, the residual, dy, dx and extra may be 16-bit (O, D)
// over float32 T rows. Every value is widened to double as it is read, so the same code gives the
// same bits for both. Including files must be compiled with -ffp-contract=off: a fused multiply-add
// rounds once where the scalar reference (bench/cpu_kernels_check.cpp, and baseline x86-64) rounds
// twice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fastmath.h"  // BT_CPU_CLONES
#include "widen.h"     // Note [widening loops]

namespace bt::cpu::norm {

constexpr int kSumLanes = 16;  // Note [lane sums]

inline double add_lanes(const double* a) {
  double r = 0;
  for (int k = 0; k < kSumLanes; ++k) r += a[k];
  return r;
}

// ---- layer_norm forward ----------------------------------------------------------------------
// mean = sum(x) / C; rstd = 1 / sqrt(sum((x - mean)^2) / C + eps); lane sums in double.
template <typename T>
BT_CPU_CLONES void row_stats(const T* p, int64_t C, double eps, double* mean, double* rstd) {
#if BT_CPU_WIDEN
  if constexpr (std::is_same_v<T, float>) {  // Note [widening loops]
    if (widen::use_avx2()) {
      double ss;
      widen::ln_stats_avx2(p, C, mean, &ss);
      *rstd = 1.0 / std::sqrt(ss / static_cast<double>(C) + eps);
      return;
    }
  }
#endif
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

// y = (x - mean) * rstd [* w] [+ b]. float32 rows to float32 y (Note [float normalize]): in
// float, with the mean as two floats (hi + lo) so that x - mean keeps the double mean's value
// where x is near it: (x - hi) - lo. Else in double, rounded once to O (a 16-bit y is the
// double value rounded once, Note [float32 residual stream]; float64 rows keep double).
//
// Note [float normalize]
// The statistics stay double sums (Note [lane sums]); only the element-wise y of a float32 row
// into a float32 output is float arithmetic (each op rounded, no contraction, so the same bits on
// every instruction set): twice the lanes of the double loop (2048 x 1024 float32 on one core:
// normalize 0.67 -> 0.35 ms). y is within a few float32 ulps of the row's scale of the exact
// value where the double loop rounded once (PyTorch's CPU kernel is float arithmetic too).
template <bool W, bool B, typename T, typename O>
BT_CPU_CLONES void normalize_row(const T* __restrict p, const T* __restrict w,
                                 const T* __restrict b, O* __restrict q, int64_t C, double mean,
                                 double rstd) {
  if constexpr (!std::is_same_v<T, float> || !std::is_same_v<O, float>) {
    for (int64_t i = 0; i < C; ++i) {
      double v = (static_cast<double>(p[i]) - mean) * rstd;
      if constexpr (W) v *= static_cast<double>(w[i]);
      if constexpr (B) v += static_cast<double>(b[i]);
      q[i] = static_cast<O>(v);
    }
  } else {
    const float hi = static_cast<float>(mean);
    const float lo = static_cast<float>(mean - static_cast<double>(hi));
    const float rs = static_cast<float>(rstd);
    for (int64_t i = 0; i < C; ++i) {
      float v = ((static_cast<float>(p[i]) - hi) - lo) * rs;
      if constexpr (W) v *= static_cast<float>(w[i]);
      if constexpr (B) v += static_cast<float>(b[i]);
      q[i] = static_cast<O>(v);
    }
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
    for (int64_t i = 0; i < C; ++i)
      s[i] = static_cast<T>(static_cast<Cm>(x[i]) + static_cast<Cm>(res[i]));
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
// 16-bit over float32 x. The weight comes widened to double once a call (w: C doubles, or null),
// not converted again in every row's two passes (the same values: widening is exact; 2048 x 1024
// float32 on one core: about 7% less time).
template <bool W, typename D, typename T>
BT_CPU_CLONES void backward_sums(const D* g, const T* p, const double* w, double m, double rs,
                                 int64_t C, double* s1, double* s2) {
#if BT_CPU_WIDEN
  if constexpr (std::is_same_v<D, float> && std::is_same_v<T, float>) {  // Note [widening loops]
    if (widen::use_avx2()) return widen::ln_sums_avx2<W>(g, p, w, m, rs, C, s1, s2);
  }
#endif
  const int64_t full = C / kSumLanes * kSumLanes;
  double a[kSumLanes] = {}, c[kSumLanes] = {};
  auto term = [&](int64_t i, double& ak, double& ck) {
    const double gx = static_cast<double>(g[i]) * (W ? w[i] : 1.0);
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
BT_CPU_CLONES void dx_row(const D* g, const T* p, const double* w, const O* e, O* q, int64_t C,
                          double m, double rs, double s1, double s2) {
  for (int64_t i = 0; i < C; ++i) {
    const double gx = static_cast<double>(g[i]) * (W ? w[i] : 1.0);
    const double xh = (static_cast<double>(p[i]) - m) * rs;
    double v = rs * (gx - s1 - xh * s2);
    if constexpr (E) v += static_cast<double>(e[i]);
    q[i] = static_cast<O>(v);
  }
}

template <bool W, typename D, typename T, typename S, typename O>
void backward_rows_w(const D* dy, const T* x, const double* w, const S* mp, const S* rp,
                     const O* ex, O* dx, int64_t r0, int64_t r1, int64_t C) {
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
void layer_norm_backward_rows(const D* dy, const T* x, const double* w, const S* mp, const S* rp,
                              const O* ex, O* dx, int64_t r0, int64_t r1, int64_t C) {
  if (w) {
    backward_rows_w<true>(dy, x, w, mp, rp, ex, dx, r0, r1, C);
  } else {
    backward_rows_w<false>(dy, x, w, mp, rp, ex, dx, r0, r1, C);
  }
}

// ---- layer_norm backward: dx rows and the column sums in one pass
// -------------------------------- Note [column blocks] dweight = sum dy * xhat, dbias = sum dy and
// dsum = sum dx (as stored) run down the columns. They are summed in the dx pass itself, while dy
// and x are in cache: the rows are cut into blocks of block_rows(R) rows (a function of R alone,
// never of the thread count); a block adds its rows, in order, into its own partial column sums
// (double), and the partials are then added block by block, in order, from 0. The bits depend only
// on R, C and the data; no second pass reads dy, x and dx again (2048 x 1024 float32, one core,
// kernel CPU time: 3.2 -> 2.2 ms). xhat is the dx pass's (x - mean) * rstd, so dweight's term is dy
// * ((x - mean) * rstd).
constexpr int64_t kBlockRows = 32;  // rows a partial sums, at least
constexpr int64_t kMaxBlocks = 64;  // partials at most (3 * C doubles each)

inline int64_t block_rows(int64_t R) {
  return std::max<int64_t>(kBlockRows, (R + kMaxBlocks - 1) / kMaxBlocks);
}

// N rows from r (of one block): dx, and added to the block's partial column sums pw (dweight),
// pb (dbias) when WB, pd (dsum) when DS. The N rows pass over the partials once (each column
// still adds its rows in order, so the bits of one row a pass): their loads and stores, not the
// arithmetic, bounded one row a pass (2048 x 1024 float32 on one core: 3.0 -> 2.0 ms at N = 4).
// Every pointer restrict: dx is a fresh output, the partials the caller's scratch.
template <int N, bool W, bool E, bool WB, bool DS, typename D, typename T, typename S, typename O>
BT_CPU_CLONES void backward_rows_n(const D* __restrict dy, const T* __restrict x,
                                   const double* __restrict w, const S* mp, const S* rp,
                                   const O* __restrict ex, O* __restrict dx, int64_t r, int64_t C,
                                   double* __restrict pw, double* __restrict pb,
                                   double* __restrict pd) {
  double m[N], rs[N], s1[N], s2[N];
  const int64_t o = r * C;
  const D* g = dy + o;
  const T* p = x + o;
  const O* e = E ? ex + o : nullptr;
  O* q = dx + o;
  for (int k = 0; k < N; ++k) {
    m[k] = static_cast<double>(mp[r + k]);
    rs[k] = static_cast<double>(rp[r + k]);
    backward_sums<W>(g + k * C, p + k * C, w, m[k], rs[k], C, &s1[k], &s2[k]);
  }
  for (int64_t i = 0; i < C; ++i) {
    double aw = WB ? pw[i] : 0, ab = WB ? pb[i] : 0, ad = DS ? pd[i] : 0;
    const double wi = W ? w[i] : 1.0;
    for (int k = 0; k < N; ++k) {
      const double gv = static_cast<double>(g[k * C + i]);
      const double gx = gv * wi;
      const double xh = (static_cast<double>(p[k * C + i]) - m[k]) * rs[k];
      double v = rs[k] * (gx - s1[k] - xh * s2[k]);
      if constexpr (E) v += static_cast<double>(e[k * C + i]);
      const O out = static_cast<O>(v);
      q[k * C + i] = out;
      if constexpr (WB) {
        aw += gv * xh;
        ab += gv;
      }
      if constexpr (DS) ad += static_cast<double>(out);
    }
    if constexpr (WB) pw[i] = aw, pb[i] = ab;
    if constexpr (DS) pd[i] = ad;
  }
}

constexpr int kPassRows = 4;  // rows a pass over the partial column sums

// Rows [r0, r1) (one block): dx, and the block's partial column sums (C doubles each,
// overwritten).
template <bool W, bool E, bool WB, bool DS, typename D, typename T, typename S, typename O>
void backward_block(const D* dy, const T* x, const double* w, const S* mp, const S* rp, const O* ex,
                    O* dx, int64_t r0, int64_t r1, int64_t C, double* pw, double* pb, double* pd) {
  if constexpr (WB) std::fill(pw, pw + C, 0.0), std::fill(pb, pb + C, 0.0);
  if constexpr (DS) std::fill(pd, pd + C, 0.0);
  int64_t r = r0;
  for (; r + kPassRows <= r1; r += kPassRows)
    backward_rows_n<kPassRows, W, E, WB, DS>(dy, x, w, mp, rp, ex, dx, r, C, pw, pb, pd);
  for (; r < r1; ++r) backward_rows_n<1, W, E, WB, DS>(dy, x, w, mp, rp, ex, dx, r, C, pw, pb, pd);
}

// Block [r0, r1) of dx (R, C) with its partial column sums (pw / pb when wb, pd when ds; see
// backward_block); ex (optional): a gradient added to dx (add_layer_norm's residual).
template <typename T, typename S, typename D, typename O>
void layer_norm_backward_block(const D* dy, const T* x, const double* w, const S* mp, const S* rp,
                               const O* ex, O* dx, int64_t r0, int64_t r1, int64_t C, bool wb,
                               bool ds, double* pw, double* pb, double* pd) {
#define BT_BLOCK(Wv, Ev, WBv, DSv) \
  backward_block<Wv, Ev, WBv, DSv>(dy, x, w, mp, rp, ex, dx, r0, r1, C, pw, pb, pd)
#define BT_BLOCK_E(Wv, WBv, DSv)   \
  if (ex) {                        \
    BT_BLOCK(Wv, true, WBv, DSv);  \
  } else {                         \
    BT_BLOCK(Wv, false, WBv, DSv); \
  }
#define BT_BLOCK_W(WBv, DSv)    \
  if (w) {                      \
    BT_BLOCK_E(true, WBv, DSv)  \
  } else {                      \
    BT_BLOCK_E(false, WBv, DSv) \
  }
  if (wb && ds) {
    BT_BLOCK_W(true, true)
  } else if (wb) {
    BT_BLOCK_W(true, false)
  } else {
    BT_BLOCK_W(false, true)
  }
#undef BT_BLOCK_W
#undef BT_BLOCK_E
#undef BT_BLOCK
}

// Columns [c0, c1) of the totals: out[c] = sum over blocks b = 0, 1, ... of part[b * stride + c]
// (from 0, in block order).
BT_CPU_CLONES inline void add_partials(const double* part, int64_t nblk, int64_t stride, int64_t c0,
                                       int64_t c1, double* out) {
  for (int64_t c = c0; c < c1; ++c) out[c] = 0;
  for (int64_t b = 0; b < nblk; ++b) {
    const double* pp = part + b * stride;
    for (int64_t c = c0; c < c1; ++c) out[c] += pp[c];
  }
}

}  // namespace bt::cpu::norm
