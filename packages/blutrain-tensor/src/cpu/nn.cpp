// cpu/nn.cpp: softmax / log_softmax (last dim) and fused cross_entropy on the CPU (layer_norm:
// norm.cpp). Row-wise kernels, rows split across the thread pool; statistics in double (float32
// inputs) so results match a float64 reference to float32 rounding.
#include <cmath>
#include <limits>

#include "../primitives.h"
#include "fastmath.h"
#include "loops.h"

namespace bt {

using cpu::contiguous_raw;

// exp in the compute type: the vectorisable float32 version for 16/32-bit inputs.
inline float exp_c(float x) { return cpu::fast_exp(x); }
inline double exp_c(double x) { return std::exp(x); }

// Row statistics with kLanes independent accumulators (a fixed order: deterministic) so the
// compiler vectorises them; a single running max or sum is a dependency chain it must keep
// scalar.  Max ignores NaN like std::max(m, v); exp sums accumulate in double.
constexpr int kLanes = 8;

template <typename A, typename T>
BT_CPU_CLONES A row_max(const T* p, int64_t C) {
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

// sum(exp(p[i] - m)) in double; with `sum_x`, also sum(p[i]) (label smoothing).
template <typename A, typename T>
BT_CPU_CLONES double row_exp_sum(const T* p, int64_t C, A m, double* sum_x = nullptr) {
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
  if (sum_x) *sum_x = rx;
  return r;
}

// q = exp(p - m) * inv (softmax) or p - lse (log_softmax), one row.
template <typename A, typename T>
BT_CPU_CLONES void softmax_row_out(const T* p, T* q, int64_t C, A m, A inv, A lse, bool lg) {
  if (lg) {
    for (int64_t i = 0; i < C; ++i) q[i] = static_cast<T>(static_cast<A>(p[i]) - lse);
  } else {
    for (int64_t i = 0; i < C; ++i) q[i] = static_cast<T>(exp_c(static_cast<A>(p[i]) - m) * inv);
  }
}

void Softmax::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor x = contiguous_raw(in[0]);
  const int64_t C = x.ndim() ? x.shape().back() : 1;
  const int64_t rows = C ? x.numel() / C : 0;
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = compute_t<T>;  // float for 16/32-bit inputs (exp in float, as PyTorch), else double
    const T* xp = static_cast<const T*>(x.data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    const bool lg = log;
    cpu::parallel_for(rows, C, [&](int64_t r) {
      const T* p = xp + r * C;
      T* q = o + r * C;
      A m = row_max<A>(p, C);
      if (std::isinf(m) && m < 0) m = 0;  // an all -inf row gives nan (softmax), -inf (log)
      const double s = row_exp_sum<A>(p, C, m);
      softmax_row_out<A>(p, q, C, m, static_cast<A>(1.0 / s), m + static_cast<A>(std::log(s)), lg);
    });
  });
}

void CrossEntropy::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  // Rows with a unit column stride are read in place (row stride ld); classes: the first C columns.
  Tensor x = in[0].strides()[1] == 1 && in[0].strides()[0] >= 0 ? in[0] : contiguous_raw(in[0]);
  Tensor t = contiguous_raw(in[1]);
  const int64_t N = x.shape()[0], C = classes(x), ld = x.strides()[0];
  const int64_t* tp = static_cast<const int64_t*>(t.data_ptr(name()));
  for (int64_t i = 0; i < N; ++i) {  // serial check: no throw inside OpenMP
    if (tp[i] != ignore_index && (tp[i] < 0 || tp[i] >= C)) {
      throw IndexError("[cross_entropy] target " + std::to_string(tp[i]) + " (row " +
                       std::to_string(i) + ") is out of range for " + std::to_string(C) +
                       " classes (ignore_index is " + std::to_string(ignore_index) + ")");
    }
  }
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(out[1].dtype(), name(), [&](auto stag) {
      using S = typename decltype(stag)::type;
      const T* xp = static_cast<const T*>(x.data_ptr(name()));
      S* lse_o = static_cast<S*>(out[1].data_ptr(name()));
      std::vector<double> loss(N, 0.0);
      const double ls = label_smoothing;
      cpu::parallel_for(N, C, [&](int64_t r) {
        const T* p = xp + r * ld;
        using A = compute_t<T>;  // exp in float for 16/32-bit logits, sums in double
        const A mx = row_max<A>(p, C);
        const double m = static_cast<double>(mx);
        double sum_x = 0;
        const double s = row_exp_sum<A>(p, C, mx, &sum_x);
        const double lse = m + std::log(s);
        lse_o[r] = static_cast<S>(lse);
        if (tp[r] == ignore_index) return;
        const double nll = lse - static_cast<double>(p[tp[r]]);
        // without smoothing, the plain nll: -inf logits (masked classes) do not make it 0 * inf
        loss[r] = ls == 0 ? nll : (1.0 - ls) * nll + ls * (lse - sum_x / static_cast<double>(C));
      });
      dispatch_float(out[0].dtype(), name(), [&](auto otag) {
        using O = typename decltype(otag)::type;
        O* lo = static_cast<O*>(out[0].data_ptr(name()));
        if (reduction == 0) {
          for (int64_t i = 0; i < N; ++i) lo[i] = static_cast<O>(loss[i]);
        } else {
          double s = 0;
          int64_t valid = 0;
          for (int64_t i = 0; i < N; ++i) {
            s += loss[i];
            valid += tp[i] != ignore_index;
          }
          lo[0] = static_cast<O>(reduction == 1 ? s / static_cast<double>(valid) : s);
        }
      });
    });
  });
}

}  // namespace bt
