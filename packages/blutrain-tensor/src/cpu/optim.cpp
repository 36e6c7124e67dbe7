// cpu/optim.cpp: CPU kernels of the multi-tensor optimizer primitives (optim.h): parallel loops
// over (tensor, chunk) work items, the same arithmetic (operation for operation, no FMA: this
// file is compiled with -ffp-contract=off) as the CUDA kernels, so both backends give the same
// bits for float32.
#include "../optim.h"

#include <cmath>
#include <vector>

#include "../backend.h"
#include "fastmath.h"  // BT_CPU_CLONES
#include "loops.h"

namespace bt {

namespace {

// (tensor, start) work items of at most kOptimChunk elements each.
struct WorkItem {
  size_t t;
  int64_t start, end;
};
std::vector<WorkItem> work_items(const std::vector<Tensor>& in, size_t n) {
  std::vector<WorkItem> w;
  for (size_t i = 0; i < n; ++i) {
    const int64_t m = in[i].numel();
    for (int64_t s = 0; s < m; s += kOptimChunk) w.push_back({i, s, std::min(m, s + kOptimChunk)});
  }
  return w;
}

float read_scalar(const Tensor& t) { return *t.data<float>("optim"); }

// One work item of AdamW, vectorised by BT_CPU_CLONES; this file is compiled with
// -ffp-contract=off, so every product and sum rounds as in the scalar original (and the CUDA
// kernel): the same bits.
template <bool SCALE, bool DECAY, typename T, typename S, typename M>
BT_CPU_CLONES void adamw_range(T* p, const T* g, S* m, S* v, int64_t j0, int64_t j1, M gscale,
                               M dfac, M b1c, M b2, M b2c, M b2s, M eps_m, M step_size) {
  for (int64_t j = j0; j < j1; ++j) {
    M pj = static_cast<M>(p[j]);
    M gj = static_cast<M>(g[j]);
    if constexpr (SCALE) gj = gj * gscale;
    if constexpr (DECAY) pj = pj * dfac;
    M mj = static_cast<M>(m[j]);
    M vj = static_cast<M>(v[j]);
    mj = mj + (gj - mj) * b1c;
    vj = vj * b2 + (gj * gj) * b2c;
    const M denom = std::sqrt(vj) / b2s + eps_m;
    pj = pj - (mj / denom) * step_size;
    m[j] = static_cast<S>(mj);
    v[j] = static_cast<S>(vj);
    p[j] = static_cast<T>(pj);
  }
}

// Sums of squares of K equal-length chunks side by side: each chunk's sum in its own order (one
// dependent add an element), K chains overlapping.
template <int K, typename T>
void sum_squares(const T* const* g, int64_t len, compute_t<T>* out) {
  using A = compute_t<T>;
  A s[K];
  for (int k = 0; k < K; ++k) s[k] = 0;
  for (int64_t j = 0; j < len; ++j) {
    for (int k = 0; k < K; ++k) {
      const A x = static_cast<A>(g[k][j]);
      s[k] += x * x;
    }
  }
  for (int k = 0; k < K; ++k) out[k] = s[k];
}

}  // namespace

// Scalars: computed in double from (lr, step), then rounded to the math type once per call.
void AdamW::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>&) {
  size_t k = has_copies ? 5 * n : 4 * n;
  const double lr_v = has_lr ? static_cast<double>(read_scalar(in[k++])) : lr;
  const double step_v = has_step ? static_cast<double>(read_scalar(in[k++])) : step;
  const float scale_f = has_scale ? read_scalar(in[k++]) : 1.0f;
  const double bias1 = 1.0 - std::pow(beta1, step_v);
  const double bias2_sqrt = std::sqrt(1.0 - std::pow(beta2, step_v));
  const std::vector<WorkItem> items = work_items(in, n);
  dispatch_float(in[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using M = compute_t<T>;                                                  // float or double
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;  // state type
    const M b1c = static_cast<M>(1.0 - beta1), b2 = static_cast<M>(beta2);
    const M b2c = static_cast<M>(1.0 - beta2), eps_m = static_cast<M>(eps);
    const M step_size = static_cast<M>(lr_v / bias1), b2s = static_cast<M>(bias2_sqrt);
    const M gscale = static_cast<M>(scale_f);
    const bool use_scale = has_scale;
    const int64_t count = static_cast<int64_t>(items.size());
    cpu::parallel_for(count, kOptimChunk, [&](int64_t w) {
      const WorkItem it = items[w];
      T* p = in[it.t].data<T>("adamw_");
      const T* g = in[n + it.t].data<T>("adamw_");
      S* m = in[2 * n + it.t].data<S>("adamw_");
      S* v = in[3 * n + it.t].data<S>("adamw_");
      const double wd = weight_decays[it.t];
      const bool decay = wd != 0;
      const M dfac = static_cast<M>(1.0 - lr_v * wd);
#define BT_ADAMW(SC, DC)                                                                    \
  adamw_range<SC, DC>(p, g, m, v, it.start, it.end, gscale, dfac, b1c, b2, b2c, b2s, eps_m, \
                      step_size)
      if (use_scale && decay) {
        BT_ADAMW(true, true);
      } else if (use_scale) {
        BT_ADAMW(true, false);
      } else if (decay) {
        BT_ADAMW(false, true);
      } else {
        BT_ADAMW(false, false);
      }
#undef BT_ADAMW
    });
  });
  // The kept 16-bit casts (Note [cached casts]): astype's own conversion, so the same bits.
  for (size_t i = 0; has_copies && i < n; ++i) {
    if (in[4 * n + i].defined()) cpu::copy_raw(in[4 * n + i], in[i]);
  }
}

// Per-chunk partial sums of squares (float accumulation; double for float64), then a fixed-order
// double sum of the partials: deterministic whatever the thread count.
void GradNorm::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const std::vector<WorkItem> items = work_items(in, in.size());
  std::vector<double> partial(items.size(), 0.0);
  const int64_t count = static_cast<int64_t>(items.size());
  // Groups of kGroup whole chunks of one dtype run their sums side by side (sum_squares).
  constexpr int kGroup = 8;
  auto whole_group = [&](int64_t w) {
    if (w + kGroup > count) return false;
    for (int64_t k = w; k < w + kGroup; ++k) {
      if (items[k].end - items[k].start != kOptimChunk ||
          in[items[k].t].dtype() != in[items[w].t].dtype()) {
        return false;
      }
    }
    return true;
  };
  const int64_t groups = (count + kGroup - 1) / kGroup;
  cpu::parallel_for(groups, kGroup * kOptimChunk, [&](int64_t grp) {
    const int64_t w0 = grp * kGroup, w1 = std::min(count, w0 + kGroup);
    dispatch_float(in[items[w0].t].dtype(), "grad_norm", [&](auto tag) {
      using T = typename decltype(tag)::type;
      using A = compute_t<T>;
      if (whole_group(w0)) {
        const T* g[kGroup];
        A s[kGroup];
        for (int k = 0; k < kGroup; ++k) {
          g[k] = in[items[w0 + k].t].data<T>("grad_norm") + items[w0 + k].start;
        }
        sum_squares<kGroup>(g, kOptimChunk, s);
        for (int k = 0; k < kGroup; ++k) partial[w0 + k] = static_cast<double>(s[k]);
        return;
      }
      for (int64_t w = w0; w < w1; ++w) {
        dispatch_float(in[items[w].t].dtype(), "grad_norm", [&](auto tag1) {
          using T1 = typename decltype(tag1)::type;
          const T1* g1[1] = {in[items[w].t].data<T1>("grad_norm") + items[w].start};
          compute_t<T1> s1[1];
          sum_squares<1>(g1, items[w].end - items[w].start, s1);
          partial[w] = static_cast<double>(s1[0]);
        });
      }
    });
  });
  double total = 0;
  for (double s : partial) total += s;
  const double norm = std::sqrt(total);
  if (out[0].dtype() == DType::Float64) {
    *out[0].data<double>(name()) = norm;
  } else {
    *out[0].data<float>(name()) = static_cast<float>(norm);
  }
}

// The same float arithmetic as the composed front it replaces: min(max_norm / (norm + eps), 1),
// NaN propagating (a non-finite norm poisons the step, as in PyTorch).
void ClipCoef::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const float nrm = in[0].dtype() == DType::Float64
                        ? static_cast<float>(*in[0].data<double>(name()))
                        : dispatch_float(in[0].dtype(), name(), [&](auto tag) {
                            using T = typename decltype(tag)::type;
                            return static_cast<float>(*in[0].data<T>("clip_coef"));
                          });
  const float c = static_cast<float>(max_norm) / (nrm + static_cast<float>(eps));
  *out[0].data<float>(name()) = (c < 1.0f || c != c) ? c : 1.0f;
}

// g *= T(coef), the product in the math type (as mul(g, astype(coef, g.dtype()))).
void ScaleInplace::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>&) {
  const size_t n = in.size() - 1;
  const float coef = read_scalar(in[n]);
  const std::vector<WorkItem> items = work_items(in, n);
  const int64_t count = static_cast<int64_t>(items.size());
  cpu::parallel_for(count, kOptimChunk, [&](int64_t w) {
    const WorkItem it = items[w];
    dispatch_float(in[it.t].dtype(), "scale_", [&](auto tag) {
      using T = typename decltype(tag)::type;
      using M = compute_t<T>;
      T* g = in[it.t].data<T>("scale_");
      const M c = static_cast<M>(static_cast<T>(coef));
      for (int64_t j = it.start; j < it.end; ++j) g[j] = static_cast<T>(static_cast<M>(g[j]) * c);
    });
  });
}

#ifndef BT_WITH_CUDA
void AdamW::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void GradNorm::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void ClipCoef::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void ScaleInplace::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
