// cpu/norm.cpp: layer_norm, add_layer_norm and the layer-norm backward on the CPU: rows split
// across the thread pool, the kernels in norm_kernels.h (Note [lane sums]).
// Compiled with -ffp-contract=off (CMakeLists.txt): the kernels give the bits of their scalar
// references (bench/cpu_kernels_check.cpp) on every instruction set.
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
          const T* wp = has_weight ? static_cast<const T*>(w.data_ptr(name())) : nullptr;
          const O* ep = has_extra ? static_cast<const O*>(ex.data_ptr(name())) : nullptr;
          const S* mp = static_cast<const S*>(mean.data_ptr(name()));
          const S* rp = static_cast<const S*>(rstd.data_ptr(name()));
          O* dx = static_cast<O*>(out[0].data_ptr(name()));
          for_rows(R, C, [&](int64_t r0, int64_t r1) {
            cpu::norm::layer_norm_backward_rows<T, S>(dyp, xp, wp, mp, rp, ep, dx, r0, r1, C);
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
          // Blocks of columns, each summed down all rows in order; at least two blocks per
          // thread when the columns allow (a block is never under 16 columns: one 64-byte row
          // segment).
          const int64_t threads = cpu::num_threads();
          const int64_t cb = std::clamp<int64_t>((C + 2 * threads - 1) / (2 * threads), 16,
                                                 cpu::norm::kColBlock);
          const int64_t nblk = (C + cb - 1) / cb;
          cpu::parallel_ranges(nblk, R * C >= cpu::kParallelMin ? 1 : nblk,
                               [&](int64_t b0, int64_t b1) {
            std::vector<double> acc(3 * static_cast<size_t>(cb));
            for (int64_t blk = b0; blk < b1; ++blk) {
              const int64_t c0 = blk * cb, n = std::min(C, c0 + cb) - c0;
              double *sw = acc.data(), *sb = sw + cb, *sd = sb + cb;
              cpu::norm::layer_norm_column_sums<T, S>(dyp, xp, mp, rp, dx, R, C, c0, n, dw, db,
                                                      ds, sw, sb, sd);
              for (int64_t j = 0; j < n; ++j) {
                put(dw, c0 + j, sw[j]);
                put(db, c0 + j, sb[j]);
                put(ds, c0 + j, sd[j]);
              }
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
