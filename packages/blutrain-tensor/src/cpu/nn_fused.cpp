// cpu/nn_fused.cpp: CPU kernels of the fused softmax / loss backward primitives (nn_fused.h;
// the layer norms' are in norm.cpp): row-wise, double statistics, rows split across the thread
// pool.
#include "../nn_fused.h"

#include <cmath>
#include <limits>

#include "../backend.h"
#include "fastmath.h"
#include "loops.h"
#include "softmax_kernels.h"

namespace bt {

using cpu::contiguous_raw;

void SoftmaxBackward::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor y = contiguous_raw(in[0]), dy = contiguous_raw(in[1]);
  const int64_t C = y.ndim() ? y.shape().back() : 1;
  const int64_t rows = C ? y.numel() / C : 0;
  dispatch_float(y.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* yp = static_cast<const T*>(y.data_ptr(name()));
    const T* gp = static_cast<const T*>(dy.data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    const int64_t grain = std::max<int64_t>(1, cpu::kChunk / std::max<int64_t>(C, 1));
    cpu::parallel_ranges(
        rows, rows * C >= cpu::kParallelMin ? grain : rows,
        [&](int64_t r0, int64_t r1) { cpu::softmax::backward_rows<T>(yp, gp, o, r0, r1, C, log); });
  });
}

void CrossEntropyBackward::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  // Logits rows with a unit column stride are read in place (row stride ld).  Columns >= C (the
  // padding of a padded vocabulary) get zeros; out is (N, Cx) contiguous.
  Tensor x = in[0].strides()[1] == 1 && in[0].strides()[0] >= 0 ? in[0] : contiguous_raw(in[0]);
  Tensor t = contiguous_raw(in[1]), lse = contiguous_raw(in[2]);
  Tensor g = contiguous_raw(in[3]);
  const int64_t N = x.shape()[0], Cx = x.shape()[1], C = classes(x), ld = x.strides()[0];
  const int64_t* tp = static_cast<const int64_t*>(t.data_ptr(name()));
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) valid += tp[i] != ignore_index;
  std::vector<double> scale(N, 0.0);
  dispatch_float(g.dtype(), name(), [&](auto gtag) {
    using G = typename decltype(gtag)::type;
    const G* gp = static_cast<const G*>(g.data_ptr(name()));
    for (int64_t i = 0; i < N; ++i) {
      if (tp[i] == ignore_index) continue;
      if (reduction == 0) {
        scale[i] = static_cast<double>(gp[i]);
      } else {
        scale[i] = static_cast<double>(gp[0]);
        if (reduction == 1) scale[i] /= static_cast<double>(valid);
      }
    }
  });
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_float(lse.dtype(), name(), [&](auto stag) {
      using S = typename decltype(stag)::type;
      const T* xp = static_cast<const T*>(x.data_ptr(name()));
      const S* lp = static_cast<const S*>(lse.data_ptr(name()));
      T* o = static_cast<T*>(out[0].data_ptr(name()));
      const double ls = label_smoothing, off = label_smoothing / static_cast<double>(C);
      const int64_t ii = ignore_index;
      cpu::parallel_for(N, Cx, [&](int64_t r) {
        T* q = o + r * Cx;
        if (tp[r] == ii) {
          for (int64_t i = 0; i < Cx; ++i) q[i] = static_cast<T>(0.0);
          return;
        }
        cpu::softmax::ce_grad_row(xp + r * ld, q, C, Cx, static_cast<double>(lp[r]), scale[r], off,
                                  ls, tp[r]);
      });
    });
  });
}

#ifndef BT_WITH_CUDA
void SoftmaxBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void CrossEntropyBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
