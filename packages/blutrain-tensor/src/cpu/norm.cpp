// cpu/norm.cpp: layer_norm, add_layer_norm and the layer-norm backward on the CPU: rows split
// across the thread pool, the kernels in norm_kernels.h (Note [lane sums]).
// Compiled with -ffp-contract=off (CMakeLists.txt): the kernels give the bits of their scalar
// references (bench/cpu_kernels_check.cpp) on every instruction set.
#include <memory>
#include <type_traits>
#include <vector>

#include "../backend.h"
#include "../nn_fused.h"
#include "../primitives.h"
#include "loops.h"
#include "norm_kernels.h"

namespace bt {

using cpu::contiguous_raw;

namespace {
// Rows per work item: about kChunk elements, whole rows.
int64_t row_grain(int64_t C) { return std::max<int64_t>(1, cpu::kChunk / std::max<int64_t>(C, 1)); }

// Rows of R * C elements in parallel (serial when small), f(r0, r1).
template <typename F>
void for_rows(int64_t R, int64_t C, F&& f) {
  cpu::parallel_ranges(R, R * C >= cpu::kParallelMin ? row_grain(C) : R, f);
}
}  // namespace

void LayerNorm::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor x = contiguous_raw(in[0]);
  Tensor w = has_weight ? contiguous_raw(in[1]) : Tensor();
  Tensor b = has_bias ? contiguous_raw(in[2]) : Tensor();
  const int64_t C = x.shape().back();
  const int64_t rows = C ? x.numel() / C : 0;
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    // y: T, or 16-bit over float32 rows (Note [float32 residual stream], nn_fused.h)
    dispatch_same_or_half<T>(out[0].dtype(), name(), [&](auto otag) {
      using O = typename decltype(otag)::type;
      dispatch_float(out[1].dtype(), name(), [&](auto stag) {
        using S = typename decltype(stag)::type;
        const T* xp = static_cast<const T*>(x.data_ptr(name()));
        const T* wp = has_weight ? static_cast<const T*>(w.data_ptr(name())) : nullptr;
        const T* bp = has_bias ? static_cast<const T*>(b.data_ptr(name())) : nullptr;
        O* y = static_cast<O*>(out[0].data_ptr(name()));
        S* mean_o = static_cast<S*>(out[1].data_ptr(name()));
        S* rstd_o = static_cast<S*>(out[2].data_ptr(name()));
        for_rows(rows, C, [&](int64_t r0, int64_t r1) {
          cpu::norm::layer_norm_rows<T, S>(xp, wp, bp, y, mean_o, rstd_o, r0, r1, C, eps);
        });
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
        for_rows(rows, C, [&](int64_t r0, int64_t r1) {
          cpu::norm::add_layer_norm_rows<T, compute_t<T>, S>(xp, rp, rbp, wp, bp, so, y, mean_o,
                                                             rstd_o, r0, r1, C, eps);
        });
      });
    });
  });
}

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
          // the weight widened to double once (norm_kernels.h: layer_norm backward)
          std::vector<double> wide;
          if (has_weight) {
            const T* w0 = static_cast<const T*>(w.data_ptr(name()));
            wide.resize(static_cast<size_t>(C));
            for (int64_t c = 0; c < C; ++c) wide[c] = static_cast<double>(w0[c]);
          }
          const double* wp = has_weight ? wide.data() : nullptr;
          const O* ep = has_extra ? static_cast<const O*>(ex.data_ptr(name())) : nullptr;
          const S* mp = static_cast<const S*>(mean.data_ptr(name()));
          const S* rp = static_cast<const S*>(rstd.data_ptr(name()));
          O* dx = static_cast<O*>(out[0].data_ptr(name()));
          size_t k = 1;
          void* dw = need_dweight ? out[k++].data_ptr(name()) : nullptr;
          void* db = need_dbias ? out[k++].data_ptr(name()) : nullptr;
          void* ds = need_dsum ? out[k++].data_ptr(name()) : nullptr;
          if (!dw && !db && !ds) {
            for_rows(R, C, [&](int64_t r0, int64_t r1) {
              cpu::norm::layer_norm_backward_rows<T, S>(dyp, xp, wp, mp, rp, ep, dx, r0, r1, C);
            });
            return;
          }
          // Note [column blocks]: blocks of rows, each with its partial column sums; then the
          // partials added in block order (both steps in parallel, neither order depends on
          // the thread count).
          const bool wb = dw || db;
          const int64_t br = cpu::norm::block_rows(R);
          const int64_t nblk = (R + br - 1) / br;
          const int64_t stride = 3 * C;  // a block's pw, pb, pd
          std::unique_ptr<double[]> part(new double[static_cast<size_t>(nblk * stride)]);
          cpu::parallel_ranges(
              nblk, R * C >= cpu::kParallelMin ? 1 : nblk, [&](int64_t b0, int64_t b1) {
                for (int64_t blk = b0; blk < b1; ++blk) {
                  double* pw = part.get() + blk * stride;
                  cpu::norm::layer_norm_backward_block<T, S>(dyp, xp, wp, mp, rp, ep, dx, blk * br,
                                                             std::min(R, (blk + 1) * br), C, wb,
                                                             ds != nullptr, pw, pw + C, pw + 2 * C);
                }
              });
          // float32 dweight / dbias / dsum for 16-bit rows where the front asked for them
          // (nn_fused.h); else x's dtype
          const bool f32 = out[1].dtype() == DType::Float32 && x.dtype() != DType::Float32;
          auto put = [f32](void* p, const double* v, int64_t c0, int64_t c1) {
            if (!p) return;
            for (int64_t c = c0; c < c1; ++c) {
              if (f32) {
                static_cast<float*>(p)[c] = static_cast<float>(v[c]);
              } else {
                static_cast<T*>(p)[c] = static_cast<T>(v[c]);
              }
            }
          };
          std::vector<double> tot(static_cast<size_t>(stride));
          // columns in pieces of 256 (8 KB of doubles a sum)
          const int64_t cb = 256, ncb = (C + cb - 1) / cb;
          cpu::parallel_ranges(ncb, nblk * stride >= cpu::kParallelMin ? 1 : ncb,
                               [&](int64_t q0, int64_t q1) {
                                 const int64_t c0 = q0 * cb, c1 = std::min(C, q1 * cb);
                                 for (int s = 0; s < 3; ++s) {
                                   void* dst = s == 0 ? dw : (s == 1 ? db : ds);
                                   if (!dst) continue;
                                   cpu::norm::add_partials(part.get() + s * C, nblk, stride, c0, c1,
                                                           tot.data() + s * C);
                                   put(dst, tot.data() + s * C, c0, c1);
                                 }
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

#ifndef BT_WITH_CUDA
void LayerNormBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void AddLayerNorm::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
