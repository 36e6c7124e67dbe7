// nn_v1_kernels.cuh: the v1 reference kernels of softmax / log_softmax, layer norm and
// cross-entropy, forward and backward: one block per row, scalar loads, one pass over global memory
// per quantity.  They were the library's BT_CUDA_NN_V1 path, the simple version the fast kernels
// were tested against; they left src/cuda (the library never ran them by default) and serve the
// bench programs as references on the GPU: bench/nn_check.cu (softmax, cross-entropy),
// bench/ln_fwd_check.cu, bench/ln_bwd_check.cu.  Included after src/cuda/nn_kernels.cuh and
// src/cuda/nn_fused_kernels.cuh (ce_finish_row, LnGrads).
#pragma once

#include "cuda/nn_fused_kernels.cuh"
#include "cuda/nn_kernels.cuh"

namespace bt::cuda::nn {

// ---- forward ----------------------------------------------------------------------------------
template <typename T>
__global__ void softmax_forward_v1(const T* __restrict__ x, T* __restrict__ y, int64_t C, bool lg) {
  using A = math_t<T>;
  __shared__ A scratch[64];
  const T* p = x + blockIdx.x * C;
  T* q = y + blockIdx.x * C;
  A m = -INFINITY;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) m = max(m, load_math(p + i));
  m = block_max(m, scratch, A(-INFINITY));
  if (m == -INFINITY) m = 0;  // an all -inf row: as the CPU
  A s = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s += exp(load_math(p + i) - m);
  s = block_sum(s, scratch);
  const A ls = log(s), inv = A(1) / s;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const A v = load_math(p + i);
    q[i] = convert<T>(lg ? (v - m) - ls : exp(v - m) * inv);
  }
}

// v1: x only (no residual), three passes over global memory.
template <typename T, typename S>
__global__ void layernorm_forward_v1(const T* __restrict__ x, const T* __restrict__ w,
                                     const T* __restrict__ b, T* __restrict__ y,
                                     S* __restrict__ mean_o, S* __restrict__ rstd_o, int64_t C,
                                     double eps) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const T* p = x + blockIdx.x * C;
  T* q = y + blockIdx.x * C;
  A s = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) s += load_math(p + i);
  const A mean = block_sum(s, scratch) / A(C);
  A ss = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const A d = load_math(p + i) - mean;
    ss += d * d;
  }
  const A rstd = A(1) / sqrt(block_sum(ss, scratch) / A(C) + A(eps));
  if (threadIdx.x == 0) mean_o[blockIdx.x] = mean, rstd_o[blockIdx.x] = rstd;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    A v = (load_math(p + i) - mean) * rstd;
    if (w) v *= load_math(w + i);
    if (b) v += load_math(b + i);
    q[i] = convert<T>(v);
  }
}

template <typename T, typename S, typename O>
__global__ void crossentropy_forward_v1(const T* __restrict__ x, int64_t ld,
                                        const int64_t* __restrict__ t, S* __restrict__ lse_o,
                                        O* __restrict__ loss_o, math_t<T>* __restrict__ row_loss,
                                        int64_t C, int64_t ii, double ls, DeviceErrorSink err) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const int64_t row = blockIdx.x;
  const T* p = x + row * ld;
  A m = -INFINITY;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) m = max(m, load_math(p + i));
  m = block_max(m, scratch, A(-INFINITY));
  const A mm = m == -INFINITY ? A(0) : m;
  A s = 0, sx = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const A v = load_math(p + i);
    s += exp(v - mm);
    sx += v;
  }
  s = block_sum(s, scratch);
  sx = block_sum(sx, scratch);
  if (threadIdx.x == 0)
    ce_finish_row<T, S, O>(row, mm, s, sx, p, t[row], C, ii, ls, lse_o, loss_o, row_loss, err);
}

// ---- backward ---------------------------------------------------------------------------------
// softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy).
template <typename T>
__global__ void softmax_backward_v1(const T* __restrict__ y, const T* __restrict__ dy,
                                    T* __restrict__ dx, int64_t C, bool lg) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const int64_t off = blockIdx.x * C;
  A s = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    s += lg ? load_math(dy + off + i) : load_math(dy + off + i) * load_math(y + off + i);
  }
  s = block_sum(s, scratch);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const A yv = load_math(y + off + i), gv = load_math(dy + off + i);
    dx[off + i] = convert<T>(lg ? gv - exp(yv) * s : yv * (gv - s));
  }
}

template <typename T, typename S>
__global__ void layernorm_backward_dx_v1(const T* __restrict__ dy, const T* __restrict__ x,
                                         const T* __restrict__ w, const S* __restrict__ mean,
                                         const S* __restrict__ rstd, const T* __restrict__ extra,
                                         T* __restrict__ dx, int64_t C) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const int64_t row = blockIdx.x, off = row * C;
  const A m = mean[row], rs = rstd[row];
  A s1 = 0, s2 = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const A g = load_math(dy + off + i) * (w ? load_math(w + i) : A(1));
    s1 += g;
    s2 += g * (load_math(x + off + i) - m) * rs;
  }
  s1 = block_sum(s1, scratch) / A(C);
  s2 = block_sum(s2, scratch) / A(C);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const A g = load_math(dy + off + i) * (w ? load_math(w + i) : A(1));
    const A xh = (load_math(x + off + i) - m) * rs;
    A v = rs * (g - s1 - xh * s2);
    if (extra) v += load_math(extra + off + i);
    dx[off + i] = convert<T>(v);
  }
}
// One thread per column, rows in order.
template <typename T, typename S>
__global__ void layernorm_backward_dwdb_v1(const T* __restrict__ dy, const T* __restrict__ x,
                                           const S* __restrict__ mean, const S* __restrict__ rstd,
                                           LnGrads<T> grads, int64_t R, int64_t C) {
  using A = math_t<T>;
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  A sw = 0, sb = 0;
  for (int64_t r = 0; r < R; ++r) {
    const A g = load_math(dy + r * C + c);
    sw += g * (load_math(x + r * C + c) - A(mean[r])) * A(rstd[r]);
    sb += g;
  }
  grads.put(false, c, sw);
  grads.put(true, c, sb);
}

template <typename T, typename S>
__global__ void crossentropy_backward_v1(const T* x, int64_t ldx, const int64_t* __restrict__ t,
                                         const S* __restrict__ lse, const math_t<T>* scale, T* dx,
                                         int64_t C, int64_t Cx, int64_t ii, double ls) {
  using A = math_t<T>;
  const int64_t row = blockIdx.x, tg = t[row];
  const A l = lse[row], sc = scale[row], offv = A(ls / double(C)), on = A(1 - ls);
  const bool ign = tg == ii, bad = !ign && (tg < 0 || tg >= C);
  for (int64_t i = threadIdx.x; i < Cx; i += blockDim.x) {
    A d = 0;
    if (i < C && !ign) {
      d = exp(load_math(x + row * ldx + i) - l) - offv;
      if (i == tg) d -= on;
      d = bad ? A(NAN) : d * sc;
    }
    dx[row * Cx + i] = convert<T>(d);
  }
}

}  // namespace bt::cuda::nn
