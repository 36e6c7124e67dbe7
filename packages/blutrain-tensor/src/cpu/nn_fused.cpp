// cpu/nn_fused.cpp: CPU kernels of the fused norm / loss primitives (nn_fused.h): simple,
// row-wise references with double statistics, OpenMP over rows; column reductions (dweight,
// dbias) run serially over rows in a fixed order so results are deterministic.
#include "../nn_fused.h"

#include <cmath>
#include <limits>

#include "../backend.h"
#include "fastmath.h"
#include "loops.h"

namespace bt {

using cpu::contiguous_raw;

void LayerNormBackward::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor dy = contiguous_raw(in[0]), x = contiguous_raw(in[1]);
  Tensor w = has_weight ? contiguous_raw(in[2]) : Tensor();
  Tensor mean = contiguous_raw(in[3]), rstd = contiguous_raw(in[4]);
  Tensor ex = has_extra ? contiguous_raw(in[5]) : Tensor();
  const int64_t R = x.shape()[0], C = x.shape()[1];
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    // dy D and dx / extra O: T, or 16-bit over float32 x (Note [float32 residual stream])
    dispatch_same_or_half<T>(dy.dtype(), name(), [&](auto dtag) {
      using D = typename decltype(dtag)::type;
      auto body = [&](auto otag) {
        using O = typename decltype(otag)::type;
        dispatch_float(mean.dtype(), name(), [&](auto stag) {
          using S = typename decltype(stag)::type;
          const D* dyp = static_cast<const D*>(dy.data_ptr(name()));
          const T* xp = static_cast<const T*>(x.data_ptr(name()));
          const T* wp = has_weight ? static_cast<const T*>(w.data_ptr(name())) : nullptr;
          const O* ep = has_extra ? static_cast<const O*>(ex.data_ptr(name())) : nullptr;
          const S* mp = static_cast<const S*>(mean.data_ptr(name()));
          const S* rp = static_cast<const S*>(rstd.data_ptr(name()));
          O* dx = static_cast<O*>(out[0].data_ptr(name()));
          cpu::parallel_for(R, C, [&](int64_t r) {
            const D* g = dyp + r * C;
            const T* p = xp + r * C;
            const double m = static_cast<double>(mp[r]), rs = static_cast<double>(rp[r]);
            double s1 = 0, s2 = 0;
            for (int64_t i = 0; i < C; ++i) {
              const double gx =
                  static_cast<double>(g[i]) * (wp ? static_cast<double>(wp[i]) : 1.0);
              s1 += gx;
              s2 += gx * (static_cast<double>(p[i]) - m) * rs;
            }
            s1 /= static_cast<double>(C);
            s2 /= static_cast<double>(C);
            O* q = dx + r * C;
            for (int64_t i = 0; i < C; ++i) {
              const double gx =
                  static_cast<double>(g[i]) * (wp ? static_cast<double>(wp[i]) : 1.0);
              const double xh = (static_cast<double>(p[i]) - m) * rs;
              double v = rs * (gx - s1 - xh * s2);
              if (ep) v += static_cast<double>(ep[r * C + i]);
              q[i] = static_cast<O>(v);
            }
          });
          size_t k = 1;
          void* dw = need_dweight ? out[k++].data_ptr(name()) : nullptr;
          void* db = need_dbias ? out[k++].data_ptr(name()) : nullptr;
          void* ds = need_dsum ? out[k++].data_ptr(name()) : nullptr;
          if (!dw && !db && !ds) return;
          // float32 dweight / dbias / dsum for 16-bit rows where the front asked for them
          // (nn_fused.h); else x's dtype
          const bool f32 = out[1].dtype() == DType::Float32 && x.dtype() != DType::Float32;
          auto put = [f32](void* p, int64_t c, double v) {
            if (!p) return;
            if (f32) {
              static_cast<float*>(p)[c] = static_cast<float>(v);
            } else {
              static_cast<T*>(p)[c] = static_cast<T>(v);
            }
          };
          cpu::parallel_for(C, R, [&](int64_t c) {  // one column per task: fixed row order
            double sw = 0, sb = 0, sd = 0;
            for (int64_t r = 0; r < R; ++r) {
              const double g = static_cast<double>(dyp[r * C + c]);
              sw += g * (static_cast<double>(xp[r * C + c]) - static_cast<double>(mp[r])) *
                    static_cast<double>(rp[r]);
              sb += g;
              if (ds) sd += static_cast<double>(dx[r * C + c]);  // dx as stored
            }
            put(dw, c, sw);
            put(db, c, sb);
            put(ds, c, sd);
          });
        });
      };
      if constexpr (std::is_same_v<D, T>) {
        body(type_tag<T>{});
      } else {
        dispatch_same_or_half<T>(out[0].dtype(), name(), body);  // dx: float32 or D
      }
    });
  });
}

void SoftmaxBackward::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor y = contiguous_raw(in[0]), dy = contiguous_raw(in[1]);
  const int64_t C = y.ndim() ? y.shape().back() : 1;
  const int64_t rows = C ? y.numel() / C : 0;
  dispatch_float(y.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* yp = static_cast<const T*>(y.data_ptr(name()));
    const T* gp = static_cast<const T*>(dy.data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    const bool lg = log;
    cpu::parallel_for(rows, C, [&](int64_t r) {
      const T* a = yp + r * C;
      const T* g = gp + r * C;
      T* q = o + r * C;
      double s = 0;
      for (int64_t i = 0; i < C; ++i) {
        s += lg ? static_cast<double>(g[i]) : static_cast<double>(g[i]) * static_cast<double>(a[i]);
      }
      for (int64_t i = 0; i < C; ++i) {
        const double yv = static_cast<double>(a[i]), gv = static_cast<double>(g[i]);
        q[i] = static_cast<T>(lg ? gv - std::exp(yv) * s : yv * (gv - s));
      }
    });
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
        const T* p = xp + r * ld;
        const double l = static_cast<double>(lp[r]), sc = scale[r];
        for (int64_t i = 0; i < C; ++i) {
          double d = std::exp(static_cast<double>(p[i]) - l) - off;
          if (i == tp[r]) d -= 1.0 - ls;
          q[i] = static_cast<T>(d * sc);
        }
        for (int64_t i = C; i < Cx; ++i) q[i] = static_cast<T>(0.0);
      });
    });
  });
}

void AddLayerNorm::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor x = contiguous_raw(in[0]), res = contiguous_raw(in[1]);
  Tensor w = has_weight ? contiguous_raw(in[2]) : Tensor();
  Tensor b = has_bias ? contiguous_raw(in[3]) : Tensor();
  Tensor rb = has_residual_bias ? contiguous_raw(in[4]) : Tensor();
  const int64_t C = x.shape().back();
  const int64_t rows = C ? x.numel() / C : 0;
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    // residual and y O: T, or 16-bit over float32 x (Note [float32 residual stream])
    dispatch_same_or_half<T>(out[1].dtype(), name(), [&](auto otag) {
      using O = typename decltype(otag)::type;
      dispatch_float(out[2].dtype(), name(), [&](auto stag) {
        using S = typename decltype(stag)::type;
        const T* xp = static_cast<const T*>(x.data_ptr(name()));
        const O* rp = static_cast<const O*>(res.data_ptr(name()));
        const T* wp = has_weight ? static_cast<const T*>(w.data_ptr(name())) : nullptr;
        const T* bp = has_bias ? static_cast<const T*>(b.data_ptr(name())) : nullptr;
        const T* rbp = has_residual_bias ? static_cast<const T*>(rb.data_ptr(name())) : nullptr;
        T* so = static_cast<T*>(out[0].data_ptr(name()));
        O* y = static_cast<O*>(out[1].data_ptr(name()));
        S* mean_o = static_cast<S*>(out[2].data_ptr(name()));
        S* rstd_o = static_cast<S*>(out[3].data_ptr(name()));
        const double e = eps;
        cpu::parallel_for(rows, C, [&](int64_t r) {
          T* sp = so + r * C;
          double s = 0;
          for (int64_t i = 0; i < C; ++i) {
            // The sum rounds to T once (as x + residual would); the norm reads the rounded value.
            compute_t<T> v =
                static_cast<compute_t<T>>(xp[r * C + i]) + static_cast<compute_t<T>>(rp[r * C + i]);
            if (rbp) v += static_cast<compute_t<T>>(rbp[i]);
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
          O* q = y + r * C;
          for (int64_t i = 0; i < C; ++i) {
            double v = (static_cast<double>(sp[i]) - mean) * rstd;
            if (wp) v *= static_cast<double>(wp[i]);
            if (bp) v += static_cast<double>(bp[i]);
            q[i] = static_cast<O>(v);
          }
        });
      });
    });
  });
}

#ifndef BT_WITH_CUDA
void LayerNormBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void SoftmaxBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void CrossEntropyBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void AddLayerNorm::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
