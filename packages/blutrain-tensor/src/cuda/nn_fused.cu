// cuda/nn_fused.cu: the launchers of the backward kernels of softmax, layer norm and
// cross-entropy (nn_fused.h); the kernels are in nn_fused_kernels.cuh.  One block per row, fp32
// math (double for float64).  Layer norm's dweight / dbias are reduced deterministically: each
// block accumulates its rows' partial sums per column (each column owned by one thread at a time,
// barriers between rows), writes them to a scratch tensor, and a second kernel sums the partials
// over blocks in a fixed order; no float atomics anywhere.  Layer norm backward has _v2 (a block
// per row group, 16-byte loads: every shape), _v3 (one warp per row, rows up to 1024 elements in
// registers, per-warp shared-memory dweight / dbias partials), _v4 (several warps a row, partials
// in registers), _v5 (a group of warps per row, partials in shared memory) and _v6 (rows through a
// per-group cp.async shared-memory ring, partials in registers, summed by
// layernorm_backward_reduce_v6).  v3-v5 partials are summed by layernorm_backward_reduce_v4 (many
// blocks; the serial one-thread-per-column reduce, ceil(2C / 256) blocks, stays for v2).  All of
// them are deterministic for a given grid.  Which one runs (nn_common.cuh's version switch; each
// falls back to the next that applies: 16-bit / fp32 rows of whole 16-byte vectors, aligned, and
// not too long):
//   BT_CUDA_NN_VERSION unset: ln_bwd_default: v6 on sm_80+ (kV6Default; measured best in every
//     bf16 / fp32 case of ln_bwd_check.sh); without it fp32 v5, 16-bit v5 for C <= 1024 with
//     extra, v3 for C <= 1024, v4 for longer rows.
//   2: v2.  3: v3 -> v2.  4: v4 -> v3 -> v2.
//   5: v5 -> (v4 for C > 1024) -> v3 -> v2.  6: v6 (sm_80+) -> the default without v6.
// bench/ln_bwd_check.sh checks every variant against float64 and times them next to a D2D copy,
// with the experiments that lost there (bench/ln_bwd_experiments.cuh, bench/nn_v1_kernels.cuh).
// Mixed rows (a 16-bit dy over a float32 x: Note [float32 residual stream], nn_fused.h) run v6 with
// float32 x / weight, else v2 with scalar loads (layernorm_backward_mixed; said once on stderr
// where v6 should have run).
//
// Cross-entropy backward reads the logits in their dtype and writes dlogits in that dtype in one
// pass (p = exp(x - lse) from the saved lse; no float32 copy).  Logits rows may be strided; with
// num_classes < the row width (a padded vocabulary) the padding columns get zero gradient, so the
// padded (N, Vp) gradient is written directly.  Each element is read and written
// by the same thread in the same step, so the kernel is safe with dlogits aliasing the logits.
// Version 3 (default, 16-bit / fp32, rows sharing the output's 16-byte alignment):
// crossentropy_backward_v3 (unrolled streaming loads / stores, exp as FFMA + MUFU ex2); v2
// elsewhere.
#include <algorithm>
#include <cmath>

#include "../autocast.h"  // cuda::column_sums_any
#include "../backend.h"
#include "../nn_fused.h"
#include "../notice.h"
#include "common.cuh"
#include "nn_common.cuh"
#include "nn_fused_kernels.cuh"

namespace bt {

// ================================ launchers =====================================================
namespace cuda::nn {
// The mixed backward fell to v2 where v6 should run (Note [mixed v6 shared memory]): slower, with a
// separate dsum pass (the float32 stream's -10% tok/s at GPT-2 124M before the 8-warp blocks).
// Said once a (dtype, C, extra, dsum, device) on stderr (src/notice.h) with why: the shape, or
// the shared memory v6's 8-warp block needs against what the device allows a block.
static void notice_mixed_v2(const char* op, DType dt, int64_t R, int64_t C, bool extra, bool ds,
                            bool shape_ok, size_t need, size_t optin, int device) {
  const std::string what =
      std::string(dtype_name(dt)) + " dy over float32 x, C = " + std::to_string(C) +
      (extra ? ", with the stream's gradient" : "") + (ds ? ", with a residual bias" : "");
  std::string why;
  if (!shape_ok) {
    why = "v6 takes rows of whole 16-byte vectors, 16-byte aligned (C a multiple of " +
          std::to_string(16 / itemsize(dt)) + "), up to C = 6144";
  } else if (need > optin) {
    why = "v6's 8-warp block needs " + std::to_string(need) + " bytes of shared memory, device " +
          std::to_string(device) + " allows " + std::to_string(optin) + " a block";
  } else {
    why = "v6's 8-warp block (" + std::to_string(need) + " bytes of shared memory of the " +
          std::to_string(optin) + " allowed) fits on no SM";
  }
  notice_once(
      "ln_bwd_mixed_v2/" + std::string(dtype_name(dt)) + "/" + std::to_string(C) + "/" +
          std::to_string(int(extra)) + std::to_string(int(ds)) + "/" + std::to_string(device),
      "[" + std::string(op) + "] the float32 residual stream's layer-norm backward (" + what +
          "; first seen at " + std::to_string(R) + " rows) runs the slow scalar v2 kernel: " + why +
          " (BT_CUDA_NN_VERSION=2 picks v2 without this notice)");
}

// LayerNormBackward on mixed rows (Note [float32 residual stream]): dy 16-bit T, x and the weight
// float32, extra and dx O = T or float32; dweight / dbias / dsum float32.  v6 (rows of whole
// 16-byte words on sm_80+, as the library's default for 16-bit rows; BT_CUDA_NN_VERSION 6 or
// unset), else v2 with scalar loads (every shape) and a column-sum pass for dsum.  Bytes per
// element with extra and O = T: 10 (dy 2, x 4, extra 2, dx 2).
void layernorm_backward_mixed(const LayerNormBackward& p, const std::vector<Tensor>& in,
                              std::vector<Tensor>& out) {
  const char* op = p.name();
  const int64_t R = in[1].shape()[0], C = in[1].shape()[1];
  cudaStream_t st = stream(out[0].device(), op);
  const Device dev = out[0].device();
  Tensor dy = contiguous_on(in[0], op, st), x = contiguous_on(in[1], op, st);
  Tensor w = p.has_weight ? contiguous_on(in[2], op, st) : Tensor();
  Tensor mean = contiguous_on(in[3], op, st), rstd = contiguous_on(in[4], op, st);
  Tensor ex = p.has_extra ? contiguous_on(in[5], op, st) : Tensor();
  size_t k = 1;
  void* dw_out = p.need_dweight ? out[k++].data_ptr(op) : nullptr;
  void* db_out = p.need_dbias ? out[k++].data_ptr(op) : nullptr;
  void* ds_out = p.need_dsum ? out[k].data_ptr(op) : nullptr;
  if (C == 0) return;
  if (R == 0) {  // empty batch: the parameter gradients are zeros
    for (void* q : {dw_out, db_out, ds_out}) {
      if (q) BT_CUDA_CHECK(op, cudaMemsetAsync(q, 0, C * sizeof(float), st));
    }
    return;
  }
  bool ds_done = false;
  bool v6_shape = false;  // dispatch_v5 took the rows; v6_smem: the last v6 block's bytes
  size_t v6_smem = 0;
  dispatch_cuda_half(dy.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    auto body = [&](auto otag) {
      using O = typename decltype(otag)::type;
      const T* dyp = static_cast<const T*>(dy.data_ptr(op));
      const float* xp = static_cast<const float*>(x.data_ptr(op));
      const float* wp = w.defined() ? static_cast<const float*>(w.data_ptr(op)) : nullptr;
      const float* mp = static_cast<const float*>(mean.data_ptr(op));
      const float* rp = static_cast<const float*>(rstd.data_ptr(op));
      const O* ep = ex.defined() ? static_cast<const O*>(ex.data_ptr(op)) : nullptr;
      O* dxp = static_cast<O*>(out[0].data_ptr(op));
      LnGrads<T> grads;  // float32 (the weight is a float32 tensor)
      grads.f32 = true;
      grads.dw = dw_out;
      grads.db = db_out;
      const int env = nn_version_env();
      const DeviceInfo& di = device_info(dev.index);
      // Note [mixed v6 shared memory]: a mixed row holds 8 bytes a column in the ring (dy 2,
      // x 4, extra 2) against 6 for bf16 rows, so at GPT-2's C = 768 (one warp a row: 16 row
      // groups a 16-warp block) with dsum (the residual bias) the block wants 246,016 bytes of
      // shared memory, over an H200's 232,448: G was 0 and every such backward fell to the
      // scalar v2 and a separate dsum pass (the float32 stream's -10% tok/s).  Then 8 warps a
      // block (half the ring: 123,008 bytes) keep v6.  A 15-warp block (230,640 bytes, also one
      // an SM) measured slower on an H100: 1.372 ms a step of 25 backwards against 1.285, and
      // its reduce 0.194 against 0.143; so did 8 warps with 3 ring slots (172,224 bytes): 1.371
      // against 1.284 (bench/RESULTS.md, session 53).
      auto v6 = [&](auto nwt) {
        constexpr int NW = decltype(nwt)::value;
        return dispatch_v5<T>(C, {dyp, xp, wp, ep, dxp}, [&](auto nvt, auto wt) {
          constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
          using K = LnBwdV6<T, float, NV, WPR, NW, kV6Stages, float, O>;
          LnGrads<T> g6 = grads;
          g6.ds = ds_out;
          const bool acc6 = g6.any();
          v6_shape = true;
          v6_smem = K::smem(C, ep != nullptr, g6.ds != nullptr);
          const int G = K::grid(R, C, ep != nullptr, di.sm_count, di.smem_per_block_optin, di.major,
                                op, g6.ds != nullptr);
          if (G == 0) return false;
          Tensor partial;
          float* pp = nullptr;
          if (acc6) {
            partial = empty_tensor({int64_t(G) * (g6.ds ? 3 : 2) * C}, DType::Float32, dev, op);
            pp = static_cast<float*>(partial.data_ptr(op));
          }
          K::launch(G, st, dyp, xp, wp, mp, rp, ep, dxp, pp, g6, R, C, acc6, op);
          if (acc6) {
            launch_ln_bwd_reduce_v6<T>(pp, G, C, g6, st, kV6ReducePdl && di.major >= 9, op);
          }
          ds_done = g6.ds != nullptr;
          return true;
        });
      };
      if ((env == 0 || env == 6) && di.major >= 8) {
        if (v6(ic<kV6Warps>{}) || v6(ic<8>{})) return;
        notice_mixed_v2(op, dy.dtype(), R, C, ep != nullptr, ds_out != nullptr, v6_shape, v6_smem,
                        di.smem_per_block_optin, dev.index);
      }
      // v2, scalar: a grid of resident blocks, block-local dw / db partials, then the reduce
      const bool need_acc = grads.any();
      const int threads = row_threads(C, 1);
      const int per_sm = std::max(1, std::min(8, 2048 / threads));
      const int G = static_cast<int>(std::min<int64_t>(R, int64_t(di.sm_count) * per_sm));
      Tensor partial;
      float* pp = nullptr;
      if (need_acc) {
        partial = empty_tensor({int64_t(G) * 2 * C}, DType::Float32, dev, op);
        pp = static_cast<float*>(partial.data_ptr(op));
      }
      const size_t smem = 2 * C * sizeof(float);
      if (need_acc && smem <= 40 * 1024) {
        layernorm_backward_v2<T, float, 1, true, float, O>
            <<<G, threads, smem, st>>>(dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, true);
      } else {
        layernorm_backward_v2<T, float, 1, false, float, O>
            <<<G, threads, 0, st>>>(dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, need_acc);
      }
      BT_CUDA_LAUNCH_CHECK(op);
      if (need_acc) {
        layernorm_backward_reduce<T>
            <<<static_cast<unsigned>(ceil_div(2 * C, 256)), 256, 0, st>>>(pp, G, C, grads);
        BT_CUDA_LAUNCH_CHECK(op);
      }
    };
    if (out[0].dtype() == DType::Float32) {
      body(type_tag<float>{});
    } else {
      body(type_tag<T>{});
    }
  });
  // dsum: the column sums of dx as stored (Note [residual bias]) where v6 did not sum them
  if (p.need_dsum && !ds_done) {
    cuda::column_sums_any(out[0], out[1 + size_t(p.need_dweight) + size_t(p.need_dbias)], op);
  }
}
}  // namespace cuda::nn

using namespace cuda;
using namespace cuda::nn;

// The CPU's one-pass form of the composition (Note [gelu backward]); CUDA runs the composed ops.
void GeluTanhBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  throw RuntimeError("[gelu_tanh_backward] internal: a CPU-only primitive reached the GPU");
}

void SoftmaxBackward::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor& y0 = in[0];
  const int64_t C = y0.ndim() ? y0.shape().back() : 1;
  const int64_t R = C ? y0.numel() / C : 0;
  if (R == 0) return;
  cudaStream_t st = stream(out[0].device(), name());
  Tensor y = contiguous_on(y0, name(), st), dy = contiguous_on(in[1], name(), st);
  dispatch_cuda_float(y.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* yp = static_cast<const T*>(y.data_ptr(name()));
    const T* gp = static_cast<const T*>(dy.data_ptr(name()));
    T* dxp = static_cast<T*>(out[0].data_ptr(name()));
    const unsigned grid = static_cast<unsigned>(R);
    dispatch_vec(vec_width<T>({yp, gp, dxp}), [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      softmax_backward_v2<T, V><<<grid, row_threads(C, V), 0, st>>>(yp, gp, dxp, C, log);
      BT_CUDA_LAUNCH_CHECK(name());
    });
  });
}

void LayerNormBackward::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  if (in[0].dtype() != in[1].dtype()) {  // mixed rows (Note [float32 residual stream])
    layernorm_backward_mixed(*this, in, out);
    return;
  }
  const int64_t R = in[1].shape()[0], C = in[1].shape()[1];
  cudaStream_t st = stream(out[0].device(), name());
  const Device dev = out[0].device();
  Tensor dy = contiguous_on(in[0], name(), st), x = contiguous_on(in[1], name(), st);
  Tensor w = has_weight ? contiguous_on(in[2], name(), st) : Tensor();
  Tensor mean = contiguous_on(in[3], name(), st), rstd = contiguous_on(in[4], name(), st);
  Tensor ex = has_extra ? contiguous_on(in[5], name(), st) : Tensor();
  bool ds_done = false;  // dsum written by the row kernel (v6)
  dispatch_cuda_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = math_t<T>;
    using S = stat_t<T>;
    auto ptr = [&](const Tensor& t) {
      return t.defined() ? static_cast<const T*>(t.data_ptr(name())) : nullptr;
    };
    const T *dyp = ptr(dy), *xp = ptr(x), *wp = ptr(w), *ep = ptr(ex);
    const S* mp = static_cast<const S*>(mean.data_ptr(name()));
    const S* rp = static_cast<const S*>(rstd.data_ptr(name()));
    T* dxp = static_cast<T*>(out[0].data_ptr(name()));
    size_t k = 1;
    LnGrads<T> grads;  // dweight / dbias: T, or float32 where the front asked for it
    if (need_dweight || need_dbias || need_dsum) {
      grads.f32 = sizeof(T) == 2 && out[1].dtype() == DType::Float32;
    }
    if (need_dweight) grads.dw = out[k++].data_ptr(name());
    if (need_dbias) grads.db = out[k++].data_ptr(name());
    void* ds_out = need_dsum ? out[k].data_ptr(name()) : nullptr;  // (v6 only: see below)

    const bool need_acc = grads.any();
    if (C == 0) return;
    if (R == 0) {  // empty batch: dweight / dbias are zeros
      const size_t bytes = C * (grads.f32 ? sizeof(float) : sizeof(T));
      if (grads.dw) BT_CUDA_CHECK(name(), cudaMemsetAsync(grads.dw, 0, bytes, st));
      if (grads.db) BT_CUDA_CHECK(name(), cudaMemsetAsync(grads.db, 0, bytes, st));
      return;
    }
    const int ver = nn_version(), env = nn_version_env();
    const DeviceInfo& di = device_info(dev.index);
    // BT_CUDA_NN_VERSION=5 / 6 force v5 / v6 where they apply; unset, ln_bwd_default picks
    const int want = env ? env : ln_bwd_default<T>(C, ep != nullptr, di.major);
    auto float_buffer = [&](int64_t n) {  // the dw / db partials (none without need_acc)
      if (!need_acc) return std::pair<Tensor, float*>(Tensor(), nullptr);
      Tensor t = empty_tensor({n}, DType::Float32, dev, name());
      return std::pair<Tensor, float*>(t, static_cast<float*>(t.data_ptr(name())));
    };
    auto reduce_partials = [&](const float* pp, int P) {
      layernorm_backward_reduce_v4<T>
          <<<static_cast<unsigned>(ceil_div(2 * C, 32)), dim3(32, kReduceRows), 0, st>>>(pp, P, C,
                                                                                         grads);
      BT_CUDA_LAUNCH_CHECK(name());
    };
    // v6: rows through a cp.async shared-memory ring, dw / db in registers; its partials go to
    // reduce_v6 (a programmatic dependent on sm_90+)
    if (want == 6 && dispatch_v5<T>(C, {dyp, xp, wp, ep, dxp}, [&](auto nvt, auto wt) {
          constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
          auto run = [&](auto kt) {
            using K = typename decltype(kt)::type;
            // v6 also sums dx's columns (dsum) where asked (Note [residual bias])
            LnGrads<T> g6 = grads;
            g6.ds = ds_out;
            const bool acc6 = g6.any();
            const int G = K::grid(R, C, ep != nullptr, di.sm_count, di.smem_per_block_optin,
                                  di.major, name(), g6.ds != nullptr);
            if (G == 0) return false;
            Tensor partial;
            float* pp = nullptr;
            if (acc6) {
              partial =
                  empty_tensor({int64_t(G) * (g6.ds ? 3 : 2) * C}, DType::Float32, dev, name());
              pp = static_cast<float*>(partial.data_ptr(name()));
            }
            K::launch(G, st, dyp, xp, wp, mp, rp, ep, dxp, pp, g6, R, C, acc6, name());
            if (acc6) {
              launch_ln_bwd_reduce_v6<T>(pp, G, C, g6, st, kV6ReducePdl && di.major >= 9, name());
            }
            ds_done = g6.ds != nullptr;
            return true;
          };
          return run(ln_tag<LnBwdV6<T, S, NV, WPR, kV6Warps, kV6Stages>>{});
        })) {
      return;
    }
    // v5 (nw8, no prefetch: the prefetch measured slower): a group of warps per row, dw / db
    // in shared memory; the default for fp32 and for 16-bit C <= 1024 with extra
    const bool want5 =
        want == 5 || (want == 6 && ln_bwd_default<T>(C, ep != nullptr, di.major, false) == 5);
    if (want5 && dispatch_v5<T>(C, {dyp, xp, wp, ep, dxp}, [&](auto nvt, auto wt) {
          constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
          using K = LnBwdV5<T, S, NV, WPR, kV5Warps>;
          const int G = K::grid(R, C, need_acc, di.sm_count, di.smem_per_block_optin, name());
          if (G == 0) return false;
          auto [partial, pp] = float_buffer(int64_t(G) * 2 * C);
          K::launch(G, st, dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, need_acc);
          BT_CUDA_LAUNCH_CHECK(name());
          if (need_acc) reduce_partials(pp, G);
          return true;
        })) {
      return;
    }
    if (layernorm_v4(C) &&
        dispatch_v4<T>(C, {dyp, xp, wp, ep, dxp}, [&](auto vt, auto nvt, auto wt) {
          constexpr int V = decltype(vt)::value, NV = decltype(nvt)::value;
          constexpr int WPR = decltype(wt)::value, RG = kV4BwdWarps / WPR;
          // Persistent grid: the resident blocks (1 per SM at <= 128 registers: 16 warps), fewer
          // for small R.  The partials (G * 2C floats, written and re-read once) stay small next
          // to the 3 R C elements moved.
          const size_t smem = need_acc ? size_t(2) * C * sizeof(float) : 0;
          auto kern = layernorm_backward_v4<T, S, V, NV, WPR>;
          if (smem > 48 * 1024) {
            BT_CUDA_CHECK(name(),
                          cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)));
          }
          int per_sm = 0;
          BT_CUDA_CHECK(name(), cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                    &per_sm, kern, kV4BwdWarps * 32, smem));
          per_sm = std::max(1, std::min(per_sm, 2));
          const int G = static_cast<int>(std::min<int64_t>(
              ceil_div(R, RG), int64_t(device_info(dev.index).sm_count) * per_sm));
          Tensor partial;
          float* pp = nullptr;
          if (need_acc) {
            partial = empty_tensor({int64_t(G) * 2 * C}, DType::Float32, dev, name());
            pp = static_cast<float*>(partial.data_ptr(name()));
          }
          kern<<<G, kV4BwdWarps * 32, smem, st>>>(dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, need_acc);
          BT_CUDA_LAUNCH_CHECK(name());
          if (need_acc) {
            layernorm_backward_reduce_v4<T>
                <<<static_cast<unsigned>(ceil_div(2 * C, 32)), dim3(32, kReduceRows), 0, st>>>(
                    pp, G, C, grads);
            BT_CUDA_LAUNCH_CHECK(name());
          }
        })) {
      return;
    }
    // v3 keeps dy, xhat and the weight in registers: rows up to 32 elements per lane (C <= 1024
    // in fp32 / 16-bit); longer rows run v2
    if (ver >= 3 && dispatch_v3<T, 32>(C, {dyp, xp, wp, ep, dxp}, [&](auto vtag, auto nvtag) {
          constexpr int V = decltype(vtag)::value, NV = decltype(nvtag)::value;
          // Warps per block and blocks: each block's shared memory holds a 2C float slice per
          // warp (dw | db); few blocks keep the partials (G * 2C floats) small next to the
          // 3 R C elements moved, while 16+ warps per SM keep enough loads in flight.
          const int nw = 8;
          const size_t smem = need_acc ? size_t(nw) * 2 * C * sizeof(float) : 0;
          auto kern = layernorm_backward_v3<T, S, V, NV>;
          if (smem > 48 * 1024) {
            BT_CUDA_CHECK(name(),
                          cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)));
          }
          int per_sm = 0;
          BT_CUDA_CHECK(
              name(), cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, nw * 32, smem));
          per_sm = std::max(1, std::min(per_sm, 2));
          const int G = static_cast<int>(std::min<int64_t>(
              ceil_div(R, nw), int64_t(device_info(dev.index).sm_count) * per_sm));
          Tensor partial;
          float* pp = nullptr;  // v3 never runs for float64 (dispatch_v3)
          if (need_acc) {
            partial = empty_tensor({int64_t(G) * 2 * C}, DType::Float32, dev, name());
            pp = static_cast<float*>(partial.data_ptr(name()));
          }
          kern<<<G, nw * 32, smem, st>>>(dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, need_acc);
          BT_CUDA_LAUNCH_CHECK(name());
          if (need_acc) {
            // 32 columns x kReduceRows per block: the serial one-thread-per-column reduce ran
            // only ceil(2C / 256) blocks, each summing G partials one after another
            layernorm_backward_reduce_v4<T>
                <<<static_cast<unsigned>(ceil_div(2 * C, 32)), dim3(32, kReduceRows), 0, st>>>(
                    pp, G, C, grads);
            BT_CUDA_LAUNCH_CHECK(name());
          }
        })) {
      return;
    }
    // the weight and the dweight/dbias accumulators are indexed by column, rows by row * C: a
    // vector width serves both (and keeps each column on one thread) only when a row is a whole
    // number of 16-byte vectors; see layernorm_forward
    const bool rows_aligned = (C * sizeof(T)) % 16 == 0 || (!wp && !need_acc);
    dispatch_vec(rows_aligned ? vec_width<T>({dyp, xp, wp, ep, dxp}) : 1, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      const int threads = row_threads(C, V);
      // Resident blocks, capped at 8 per SM: more blocks mean more partials to write and re-read
      // (G * 2C floats) for little extra bandwidth.
      const int per_sm = std::max(1, std::min(8, 2048 / threads));
      const int G =
          static_cast<int>(std::min<int64_t>(R, int64_t(device_info(dev.index).sm_count) * per_sm));
      Tensor partial;
      A* pp = nullptr;
      if (need_acc) {
        partial =
            empty_tensor({int64_t(G) * 2 * C},
                         std::is_same_v<A, double> ? DType::Float64 : DType::Float32, dev, name());
        pp = static_cast<A*>(partial.data_ptr(name()));
      }
      const size_t smem = 2 * C * sizeof(A);
      // below the 48 KB default with room for the kernel's static reduction buffers (C = 6144
      // fp32 asked for exactly 48 KB and failed to launch)
      if (need_acc && smem <= 40 * 1024) {
        layernorm_backward_v2<T, S, V, true>
            <<<G, threads, smem, st>>>(dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, true);
      } else {
        layernorm_backward_v2<T, S, V, false>
            <<<G, threads, 0, st>>>(dyp, xp, wp, mp, rp, ep, dxp, pp, R, C, need_acc);
      }
      BT_CUDA_LAUNCH_CHECK(name());
      if (need_acc) {
        layernorm_backward_reduce<T>
            <<<static_cast<unsigned>(ceil_div(2 * C, 256)), 256, 0, st>>>(pp, G, C, grads);
        BT_CUDA_LAUNCH_CHECK(name());
      }
    });
  });
  // dsum: the column sums of dx as stored (Note [residual bias]): v6 sums them in its row pass;
  // after the other kernels, a column-sum pass over dx.
  if (need_dsum && !ds_done) {
    cuda::column_sums_any(out[0], out[1 + size_t(need_dweight) + size_t(need_dbias)], name());
  }
}

void CrossEntropyBackward::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const int64_t N = in[0].shape()[0], Cx = in[0].shape()[1];
  if (N == 0 || Cx == 0) return;
  cudaStream_t st = stream(out[0].device(), name());
  // rows with a unit column stride are read in place (a narrow / padded view: no copy)
  Tensor x = rows_in_place(in[0]) ? in[0] : contiguous_on(in[0], name(), st);
  Tensor t = contiguous_on(in[1], name(), st);
  Tensor lse = contiguous_on(in[2], name(), st), g = contiguous_on(in[3], name(), st);
  const int64_t C = classes(x), ldx = x.strides()[0];
  dispatch_cuda_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = math_t<T>;
    using S = stat_t<T>;
    const int64_t* tp = static_cast<const int64_t*>(t.data_ptr(name()));
    Tensor scale = empty_tensor({N}, std::is_same_v<A, double> ? DType::Float64 : DType::Float32,
                                x.device(), name());
    A* sp = static_cast<A*>(scale.data_ptr(name()));
    dispatch_cuda_float(g.dtype(), name(), [&](auto gtag) {
      using G = typename decltype(gtag)::type;
      crossentropy_row_scale<G, A><<<1, 1024, 0, st>>>(
          tp, static_cast<const G*>(g.data_ptr(name())), N, ignore_index, reduction, sp);
      BT_CUDA_LAUNCH_CHECK(name());
    });
    const T* xp = static_cast<const T*>(x.data_ptr(name()));
    const S* lp = static_cast<const S*>(lse.data_ptr(name()));
    T* dxp = static_cast<T*>(out[0].data_ptr(name()));
    const unsigned grid = static_cast<unsigned>(N);
    const int ver = nn_version();
    // vector width: logits row r and output row r must share their 16-byte alignment
    const bool rows_match = N == 1 || ((ldx - Cx) * int64_t(sizeof(T))) % 16 == 0;
    if constexpr (!std::is_same_v<T, double>) {
      if (ver >= 3 && Cx <= kCeMaxC && rows_match &&
          vec_width<T>({xp, dxp}) == static_cast<int>(16 / sizeof(T))) {
        crossentropy_backward_v3<T, S><<<grid, ce_threads(Cx, 16 / sizeof(T)), 0, st>>>(
            xp, ldx, tp, lp, sp, dxp, static_cast<int>(C), static_cast<int>(Cx), ignore_index,
            label_smoothing);
        BT_CUDA_LAUNCH_CHECK(name());
        return;
      }
    }
    dispatch_vec(rows_match ? vec_width<T>({xp, dxp}) : 1, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      crossentropy_backward_v2<T, S, V><<<grid, row_threads(Cx, V, 512), 0, st>>>(
          xp, ldx, tp, lp, sp, dxp, C, Cx, ignore_index, label_smoothing);
      BT_CUDA_LAUNCH_CHECK(name());
    });
  });
}

}  // namespace bt
