// cpu/nn.cpp: softmax / log_softmax (last dim) and fused cross_entropy on the CPU (layer_norm:
// norm.cpp). Row-wise kernels, rows split across the thread pool; statistics in double (float32
// inputs) so results match a float64 reference to float32 rounding.
#include <cmath>
#include <limits>

#include "../primitives.h"
#include "loops.h"
#include "softmax_kernels.h"

namespace bt {

using cpu::contiguous_raw;
using namespace cpu::softmax;

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
      if (std::isinf(m) && m < 0) m = 0;  // an all -inf row: s = 0, so NaN (as PyTorch)
      if constexpr (std::is_same_v<T, float>) {
        if (!lg) {  // float32: each exp once, kept in the output (softmax_row_store)
          const double s = row_exp_sum_store(p, q, C, m);
          scale_row(q, C, static_cast<float>(1.0 / s));
          return;
        }
      }
      const double s = row_exp_sum<A>(p, C, m);
      softmax_row_out<A>(p, q, C, m, static_cast<A>(1.0 / s), static_cast<A>(std::log(s)), lg);
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
        A mx = row_max<A>(p, C);
        // an all -inf row: s = 0, so lse = log(0) = -inf (as torch.logsumexp and the CUDA
        // kernels), its loss and gradient NaN (as PyTorch); a NaN in the row keeps lse NaN
        if (std::isinf(mx) && mx < 0) mx = 0;
        const double m = static_cast<double>(mx);
        double sum_x = 0;
        const double s = row_exp_sum<A>(p, C, mx, ls == 0 ? nullptr : &sum_x);
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
