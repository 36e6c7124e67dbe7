// cuda/nn.cu: the launchers of softmax / log_softmax (last dim), layer norm (+ the fused
// residual add) and fused cross-entropy forward on CUDA; the kernels are in nn_kernels.cuh.  One
// block per row, fp32 math (double for float64), statistics reduced with fixed-order block
// reductions (deterministic).  Each op has a block-per-row kernel (_v2: 16-byte vector loads,
// online max/sum) that takes every shape; softmax and layer norm also have _v3 (one warp per row,
// the row in registers, several rows per block) for rows up to 3072 elements; layer norm also _v4
// (a group of warps per row) and _v6 (persistent, rows through a cp.async shared-memory ring: the
// default for 16-bit rows over 1024).  Which runs: nn_common.cuh (BT_CUDA_NN_VERSION=2..6 forces
// one where it applies, for tests and benches).  The v1 references (scalar loads, one pass per
// quantity) moved to bench/nn_v1_kernels.cuh, where bench/nn_check.cu and bench/ln_fwd_check.cu
// check the library's kernels against them and a float64 reference.  Mixed rows (a float32 x with a
// 16-bit y: Note [float32 residual stream], nn_fused.h) run layernorm_forward_mixed_v3 (v3's
// layout) or _v2 (every shape).
//
// Cross-entropy never materialises float32 logits: it reads the logits in their dtype once
// (online max / sum of exp / sum of x) and writes only float32 lse and the loss.  Rows may be
// strided (a narrow of padded logits is read in place) and only the first num_classes columns
// count; an out-of-range target is reported through index.cu's error record (IndexError at the
// next synchronisation).  Version 3 (the default for 16-bit / fp32 logits):
// crossentropy_forward_v3, streaming at memory speed, exp as FFMA + MUFU ex2 (v2: float64 and
// rows longer than kCeMaxC); crossentropy_fwd_bwd_v4 (the chunked classifier's) also writes the
// gradient of the summed loss over the logits from a shared-memory copy of the row, reading the
// logits once.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "../autocast.h"  // cuda::cross_entropy_fwd_bwd_inplace
#include "../backend.h"
#include "../nn_fused.h"
#include "../primitives.h"
#include "common.cuh"
#include "nn_common.cuh"
#include "nn_kernels.cuh"

namespace bt {
namespace cuda::nn {

// ================================ launchers =====================================================

// Resident blocks per SM of forward v6 kernel L for rows of C on device dev, queried once per
// (L, C, dev).  Locking: each L's mutex guards its cache (eval_gpu may run on several host
// threads); the query itself runs under it (once per key).
template <typename L>
int ln_fwd_v6_per_sm(int64_t C, int dev, const DeviceInfo& di, const char* op) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, int>, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find({C, dev});
  if (it == cache.end()) {
    it = cache.emplace(std::make_pair(C, dev), L::per_sm(C, di.smem_per_block_optin, di.major, op))
             .first;
  }
  return it->second;
}

// Launches forward v6 and returns true, or false where it does not apply (dispatch_v5's rules,
// compute capability below 8, rows too long for the rings).
template <typename T>
bool launch_ln_fwd_v6(int dev, cudaStream_t st, const T* xp, const T* rp, const T* wp, const T* bp,
                      T* sp, T* yp, float* mp, float* rsp, int64_t R, int64_t C, double eps,
                      const char* op) {
  return dispatch_v5<T>(C, {xp, rp, wp, bp, sp, yp}, [&](auto nvt, auto wt) {
    constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
    auto go = [&](auto addt) {
      constexpr bool kAdd = decltype(addt)::value;
      using L = LnFwdV6<T, float, NV, WPR, kLnFwdV6Warps, kLnFwdV6Stages, kAdd>;
      const DeviceInfo& di = device_info(dev);
      const int per_sm = ln_fwd_v6_per_sm<L>(C, dev, di, op);
      if (per_sm == 0) return false;
      L::launch(L::grid(R, per_sm, di.sm_count), st, xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps);
      BT_CUDA_LAUNCH_CHECK(op);
      return true;
    };
    return rp ? go(std::true_type{}) : go(std::false_type{});
  });
}

void layernorm_forward(const Tensor& x, const Tensor& res, const Tensor& w, const Tensor& b,
                       Tensor* sum_o, Tensor& y, Tensor& mean, Tensor& rstd, double eps,
                       const char* op) {
  const int64_t C = x.shape().back();
  const int64_t R = C ? x.numel() / C : 0;
  if (R == 0) return;
  cudaStream_t st = stream(y.device(), op);
  Tensor xc = contiguous_on(x, op, st), rc = contiguous_on(res, op, st);
  Tensor wc = contiguous_on(w, op, st), bc = contiguous_on(b, op, st);
  const bool add = res.defined();
  dispatch_cuda_float(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    {
      using S = stat_t<T>;
      auto ptr = [&](const Tensor& t) {
        return t.defined() ? static_cast<const T*>(t.data_ptr(op)) : nullptr;
      };
      const T *xp = ptr(xc), *rp = ptr(rc), *wp = ptr(wc), *bp = ptr(bc);
      T* yp = static_cast<T*>(y.data_ptr(op));
      T* sp = add ? static_cast<T*>(sum_o->data_ptr(op)) : nullptr;
      S* mp = static_cast<S*>(mean.data_ptr(op));
      S* rsp = static_cast<S*>(rstd.data_ptr(op));
      const int ver = nn_version();
      if constexpr (sizeof(S) == 4 && sizeof(T) != 8) {
        const int env = nn_version_env();
        if ((env == 6 || (env == 0 && ln_fwd_v6_default<T>(C))) &&
            launch_ln_fwd_v6<T>(y.device().index, st, xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps,
                                op)) {
          return;
        }
      }
      if (layernorm_v4(C) &&
          dispatch_v4<T>(C, {xp, rp, wp, bp, yp, sp}, [&](auto vt, auto nvt, auto wt) {
            constexpr int V = decltype(vt)::value, NV = decltype(nvt)::value;
            constexpr int WPR = decltype(wt)::value;
            const unsigned grid = static_cast<unsigned>(ceil_div(R, kV4Warps / WPR));
            if (add) {
              layernorm_forward_v4<T, S, V, NV, WPR, true>
                  <<<grid, kV4Warps * 32, 0, st>>>(xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps);
            } else {
              layernorm_forward_v4<T, S, V, NV, WPR, false>
                  <<<grid, kV4Warps * 32, 0, st>>>(xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps);
            }
            BT_CUDA_LAUNCH_CHECK(op);
          })) {
        return;
      }
      if (ver >= 3 && dispatch_v3<T>(C, {xp, rp, wp, bp, yp, sp}, [&](auto vtag, auto nvtag) {
            constexpr int V = decltype(vtag)::value, NV = decltype(nvtag)::value;
            const unsigned grid = static_cast<unsigned>(ceil_div(R, kV3Warps));
            if (add) {
              layernorm_forward_v3<T, S, V, NV, true>
                  <<<grid, kV3Warps * 32, 0, st>>>(xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps);
            } else {
              layernorm_forward_v3<T, S, V, NV, false>
                  <<<grid, kV3Warps * 32, 0, st>>>(xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps);
            }
            BT_CUDA_LAUNCH_CHECK(op);
          })) {
        return;
      }
      // weight / bias are indexed by column, rows by row * C: one vector width serves both only
      // when a row is a whole number of 16-byte vectors
      const bool rows_aligned = (C * sizeof(T)) % 16 == 0 || (!wp && !bp);
      const int vw = !rows_aligned ? 1 : vec_width<T>({xp, rp, wp, bp, yp, sp});
      dispatch_vec(vw, [&](auto vtag) {
        constexpr int V = decltype(vtag)::value;
        const int threads = row_threads(C, V);
        if (add) {
          layernorm_forward_v2<T, S, V, true><<<static_cast<unsigned>(R), threads, 0, st>>>(
              xp, rp, wp, bp, sp, yp, mp, rsp, C, eps);
        } else {
          layernorm_forward_v2<T, S, V, false><<<static_cast<unsigned>(R), threads, 0, st>>>(
              xp, rp, wp, bp, sp, yp, mp, rsp, C, eps);
        }
        BT_CUDA_LAUNCH_CHECK(op);
      });
    }
  });
}

// add_layer_norm with a residual bias (Note [residual bias]) through v3, the one kernel that
// adds it; false (nothing done) where v3 does not apply (the caller adds the bias first).
bool add_layernorm_forward_bias(const Tensor& x, const Tensor& res, const Tensor& w,
                                const Tensor& b, const Tensor& rb, Tensor& sum_o, Tensor& y,
                                Tensor& mean, Tensor& rstd, double eps, const char* op) {
  const int64_t C = x.shape().back();
  const int64_t R = C ? x.numel() / C : 0;
  if (R == 0) return true;
  if (nn_version() < 3 || x.dtype() == DType::Float64) return false;
  cudaStream_t st = stream(y.device(), op);
  Tensor xc = contiguous_on(x, op, st), rc = contiguous_on(res, op, st);
  Tensor wc = contiguous_on(w, op, st), bc = contiguous_on(b, op, st);
  Tensor rbc = contiguous_on(rb, op, st);
  bool done = false;
  dispatch_cuda_float(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, double>) {
      using S = stat_t<T>;
      auto ptr = [&](const Tensor& t) {
        return t.defined() ? static_cast<const T*>(t.data_ptr(op)) : nullptr;
      };
      const T *xp = ptr(xc), *rp = ptr(rc), *wp = ptr(wc), *bp = ptr(bc), *rbp = ptr(rbc);
      T* yp = static_cast<T*>(y.data_ptr(op));
      T* sp = static_cast<T*>(sum_o.data_ptr(op));
      S* mp = static_cast<S*>(mean.data_ptr(op));
      S* rsp = static_cast<S*>(rstd.data_ptr(op));
      done = dispatch_v3<T>(C, {xp, rp, wp, bp, yp, sp, rbp}, [&](auto vtag, auto nvtag) {
        constexpr int V = decltype(vtag)::value, NV = decltype(nvtag)::value;
        const unsigned grid = static_cast<unsigned>(ceil_div(R, kV3Warps));
        layernorm_forward_v3<T, S, V, NV, true>
            <<<grid, kV3Warps * 32, 0, st>>>(xp, rp, wp, bp, sp, yp, mp, rsp, R, C, eps, rbp);
        BT_CUDA_LAUNCH_CHECK(op);
      });
    }
  });
  return done;
}

// layer_norm / add_layer_norm on mixed rows (Note [float32 residual stream]): x float32, y of a
// 16-bit dtype; with res (y's dtype), sum_o (float32) and optionally rb (float32) the add.
void layernorm_forward_mixed(const Tensor& x, const Tensor& res, const Tensor& w, const Tensor& b,
                             const Tensor& rb, Tensor* sum_o, Tensor& y, Tensor& mean, Tensor& rstd,
                             double eps, const char* op) {
  const int64_t C = x.shape().back();
  const int64_t R = C ? x.numel() / C : 0;
  if (R == 0) return;
  cudaStream_t st = stream(y.device(), op);
  Tensor xc = contiguous_on(x, op, st), rc = contiguous_on(res, op, st);
  Tensor wc = contiguous_on(w, op, st), bc = contiguous_on(b, op, st);
  Tensor rbc = contiguous_on(rb, op, st);
  const bool add = res.defined();
  dispatch_cuda_half(y.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto fptr = [&](const Tensor& t) {
      return t.defined() ? static_cast<const float*>(t.data_ptr(op)) : nullptr;
    };
    const float *xp = fptr(xc), *wp = fptr(wc), *bp = fptr(bc), *rbp = fptr(rbc);
    const T* rp = add ? static_cast<const T*>(rc.data_ptr(op)) : nullptr;
    float* sp = add ? static_cast<float*>(sum_o->data_ptr(op)) : nullptr;
    T* yp = static_cast<T*>(y.data_ptr(op));
    float* mp = static_cast<float*>(mean.data_ptr(op));
    float* rsp = static_cast<float*>(rstd.data_ptr(op));
    // v3's checks with T's 16-byte words: C % 8 == 0, every pointer 16-byte aligned (the float32
    // rows then start on 32-byte multiples), at most 96 columns a lane (C <= 3072)
    if (nn_version() >= 3 && dispatch_v3<T>(C, {xp, rp, wp, bp, rbp, sp, yp}, [&](auto, auto nvt) {
          constexpr int NV = decltype(nvt)::value;
          const unsigned grid = static_cast<unsigned>(ceil_div(R, kV3Warps));
          if (add) {
            layernorm_forward_mixed_v3<T, NV, true>
                <<<grid, kV3Warps * 32, 0, st>>>(xp, rp, wp, bp, rbp, sp, yp, mp, rsp, R, C, eps);
          } else {
            layernorm_forward_mixed_v3<T, NV, false>
                <<<grid, kV3Warps * 32, 0, st>>>(xp, rp, wp, bp, rbp, sp, yp, mp, rsp, R, C, eps);
          }
          BT_CUDA_LAUNCH_CHECK(op);
        })) {
      return;
    }
    const unsigned grid = static_cast<unsigned>(R);
    const int threads = row_threads(C, 1, 256);
    if (add) {
      layernorm_forward_mixed_v2<T, true>
          <<<grid, threads, 0, st>>>(xp, rp, wp, bp, rbp, sp, yp, mp, rsp, C, eps);
    } else {
      layernorm_forward_mixed_v2<T, false>
          <<<grid, threads, 0, st>>>(xp, rp, wp, bp, rbp, sp, yp, mp, rsp, C, eps);
    }
    BT_CUDA_LAUNCH_CHECK(op);
  });
}

}  // namespace cuda::nn

using namespace cuda;
using namespace cuda::nn;

void Softmax::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor& x0 = in[0];
  const int64_t C = x0.ndim() ? x0.shape().back() : 1;
  const int64_t R = C ? x0.numel() / C : 0;
  if (R == 0) return;
  cudaStream_t st = stream(out[0].device(), name());
  Tensor x = contiguous_on(x0, name(), st);
  dispatch_cuda_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x.data_ptr(name()));
    T* yp = static_cast<T*>(out[0].data_ptr(name()));
    const int ver = nn_version();
    if (ver >= 3 && dispatch_v3<T>(C, {xp, yp}, [&](auto vtag, auto nvtag) {  // 4: as 3
          constexpr int V = decltype(vtag)::value, NV = decltype(nvtag)::value;
          softmax_forward_v3<T, V, NV>
              <<<static_cast<unsigned>(ceil_div(R, kV3Warps)), kV3Warps * 32, 0, st>>>(xp, yp, R, C,
                                                                                       log);
          BT_CUDA_LAUNCH_CHECK(name());
        })) {
      return;
    }
    dispatch_vec(vec_width<T>({xp, yp}), [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      softmax_forward_v2<T, V>
          <<<static_cast<unsigned>(R), row_threads(C, V), 0, st>>>(xp, yp, C, log);
      BT_CUDA_LAUNCH_CHECK(name());
    });
  });
}

void LayerNorm::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  if (out[0].dtype() != in[0].dtype()) {  // mixed (Note [float32 residual stream])
    layernorm_forward_mixed(in[0], Tensor(), has_weight ? in[1] : Tensor(),
                            has_bias ? in[2] : Tensor(), Tensor(), nullptr, out[0], out[1], out[2],
                            eps, name());
    return;
  }
  layernorm_forward(in[0], Tensor(), has_weight ? in[1] : Tensor(), has_bias ? in[2] : Tensor(),
                    nullptr, out[0], out[1], out[2], eps, name());
}

void AddLayerNorm::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  if (mixed) {  // Note [float32 residual stream]
    layernorm_forward_mixed(in[0], in[1], has_weight ? in[2] : Tensor(),
                            has_bias ? in[3] : Tensor(), has_residual_bias ? in[4] : Tensor(),
                            &out[0], out[1], out[2], out[3], eps, name());
    return;
  }
  Tensor res = in[1];
  if (has_residual_bias) {
    if (add_layernorm_forward_bias(in[0], in[1], has_weight ? in[2] : Tensor(),
                                   has_bias ? in[3] : Tensor(), in[4], out[0], out[1], out[2],
                                   out[3], eps, name())) {
      return;
    }
    // Elsewhere (float64, rows v3 does not take): residual + residual_bias first, a separate
    // broadcast add (two roundings in 16-bit instead of one).
    const Tensor& rb = in[4];
    const int64_t C = res.shape().back(), R = C ? res.numel() / C : 0;
    const Tensor rc = contiguous_on(res, name(), stream(res.device(), name()));
    const Tensor rows = make_view(rc, {R, C}, {C, 1}, rc.offset());
    const Tensor rbv = make_view(rb, {R, C}, {0, rb.strides()[0]}, rb.offset());
    Tensor sum2 = empty_tensor({R, C}, res.dtype(), res.device(), name());
    std::vector<Tensor> o{sum2};
    Binary(BinaryOp::Add).eval_gpu({rows, rbv}, o);
    res = sum2;
  }
  layernorm_forward(in[0], res, has_weight ? in[2] : Tensor(), has_bias ? in[3] : Tensor(), &out[0],
                    out[1], out[2], out[3], eps, name());
}

void CrossEntropy::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const int64_t N = in[0].shape()[0];
  cudaStream_t st = stream(out[0].device(), name());
  // rows with a unit column stride are read in place: no copy of a narrow / padded view
  Tensor x = rows_in_place(in[0]) ? in[0] : contiguous_on(in[0], name(), st);
  Tensor t = contiguous_on(in[1], name(), st);
  const int64_t C = classes(x), ld = x.strides()[0];
  dispatch_cuda_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = math_t<T>;
    // The loss has the dtype the front chose (the logits' by default, as PyTorch).
    dispatch_cuda_float(out[0].dtype(), name(), [&](auto otag) {
      using O = typename decltype(otag)::type;
      using S = stat_t<T>;
      O* lo = static_cast<O*>(out[0].data_ptr(name()));
      if (N == 0) {
        if (reduction != 0) {  // empty mean is nan, empty sum 0 (as the CPU)
          crossentropy_reduce<A, O>
              <<<1, 32, 0, st>>>(nullptr, nullptr, 0, ignore_index, reduction == 1, lo);
          BT_CUDA_LAUNCH_CHECK(name());
        }
        return;
      }
      const T* xp = static_cast<const T*>(x.data_ptr(name()));
      const int64_t* tp = static_cast<const int64_t*>(t.data_ptr(name()));
      S* lse = static_cast<S*>(out[1].data_ptr(name()));
      const DeviceErrorSink err =
          device_error_sink(x.device().index, kIndexErrorCrossEntropy, name());
      Tensor rl;
      A* rlp = nullptr;
      if (reduction != 0) {
        rl = empty_tensor({N}, std::is_same_v<A, double> ? DType::Float64 : DType::Float32,
                          x.device(), name());
        rlp = static_cast<A*>(rl.data_ptr(name()));
      }
      O* lrow = reduction == 0 ? lo : nullptr;
      const int ver = nn_version();
      if constexpr (!std::is_same_v<T, double>) {
        if (ver >= 3 && C <= kCeMaxC) {  // 4: as 3
          const int threads = ce_threads(C, 16 / sizeof(T));
          auto launch = [&](auto kern) {
            kern<<<static_cast<unsigned>(N), threads, 0, st>>>(xp, ld, tp, lse, lrow, rlp,
                                                               static_cast<int>(C), ignore_index,
                                                               label_smoothing, err);
            BT_CUDA_LAUNCH_CHECK(name());
          };
          if (label_smoothing != 0) {
            launch(crossentropy_forward_v3<T, S, O, true>);
          } else {
            launch(crossentropy_forward_v3<T, S, O, false>);
          }
          if (reduction != 0) {
            crossentropy_reduce<A, O>
                <<<1, 1024, 0, st>>>(rlp, tp, N, ignore_index, reduction == 1, lo);
            BT_CUDA_LAUNCH_CHECK(name());
          }
          return;
        }
      }
      dispatch_vec(vec_width<T>({xp}), [&](auto vtag) {
        constexpr int V = decltype(vtag)::value;
        crossentropy_forward_v2<T, S, O, V>
            <<<static_cast<unsigned>(N), row_threads(C, V, 512), 0, st>>>(
                xp, ld, tp, lse, lrow, rlp, C, ignore_index, label_smoothing, err);
        BT_CUDA_LAUNCH_CHECK(name());
      });
      if (reduction != 0) {
        crossentropy_reduce<A, O><<<1, 1024, 0, st>>>(rlp, tp, N, ignore_index, reduction == 1, lo);
        BT_CUDA_LAUNCH_CHECK(name());
      }
    });
  });
}

// The chunked classifier's cross-entropy on one chunk (autocast.h): v4 where it applies.
bool cuda::cross_entropy_fwd_bwd_inplace(const Tensor& logits, const Tensor& target,
                                         const Tensor& lse, const Tensor& row_loss,
                                         const Tensor& scale, int64_t num_classes,
                                         int64_t ignore_index, const char* op) {
  if (const char* e = std::getenv("BT_CUDA_CE_FUSED"); e && e[0] == '0') return false;
  const DType dt = logits.dtype();
  if (dt != DType::BFloat16 && dt != DType::Float16 && dt != DType::Float32) return false;
  if (logits.ndim() != 2 || !logits.is_contiguous() || row_loss.dtype() != DType::Float32 ||
      lse.dtype() != DType::Float32 || !row_loss.is_contiguous() || !lse.is_contiguous() ||
      (scale.defined() && scale.dtype() != DType::Float32)) {
    return false;
  }
  const int64_t N = logits.shape()[0], Cx = logits.shape()[1], C = num_classes;
  const int64_t esize = static_cast<int64_t>(itemsize(dt));
  if (N == 0 || C < 1 || C > Cx || Cx > kCeMaxC || (Cx * esize) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(logits.data_ptr(op)) % 16 != 0 || nn_version() < 3) {
    return false;
  }
  const DeviceInfo& di = device_info(logits.device().index);
  const size_t smem = static_cast<size_t>((C * esize + 15) / 16 * 16);
  if (smem > di.smem_per_block_optin) return false;
  cudaStream_t st = stream(logits.device(), op);
  Tensor tc = contiguous_on(target, op, st);
  const DeviceErrorSink err = device_error_sink(logits.device().index, kIndexErrorCrossEntropy, op);
  const int threads = row_threads(Cx, static_cast<int>(16 / esize), kCeMaxThreads);
  dispatch_cuda_float(dt, op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, double>) {
      auto kern = crossentropy_fwd_bwd_v4<T>;
      BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
      kern<<<static_cast<unsigned>(N), threads, smem, st>>>(
          static_cast<T*>(logits.data_ptr(op)), static_cast<const int64_t*>(tc.data_ptr(op)),
          static_cast<float*>(lse.data_ptr(op)), static_cast<float*>(row_loss.data_ptr(op)),
          scale.defined() ? scale.data<float>(op) : nullptr, static_cast<int>(C),
          static_cast<int>(Cx), ignore_index, err);
      BT_CUDA_LAUNCH_CHECK(op);
    }
  });
  return true;
}

void cuda::count_targets(const Tensor& target, int64_t ignore_index, const Tensor& count,
                         const Tensor& inverse, const char* op) {
  cudaStream_t st = stream(target.device(), op);
  Tensor tc = contiguous_on(target, op, st);
  const int64_t* tp = static_cast<const int64_t*>(tc.data_ptr(op));
  const int64_t N = tc.numel();
  if (count.dtype() == DType::Float64) {
    count_targets_kernel<double>
        <<<1, 1024, 0, st>>>(tp, N, ignore_index, count.data<double>(op), inverse.data<double>(op));
  } else {
    count_targets_kernel<float>
        <<<1, 1024, 0, st>>>(tp, N, ignore_index, count.data<float>(op), inverse.data<float>(op));
  }
  BT_CUDA_LAUNCH_CHECK(op);
}

}  // namespace bt
