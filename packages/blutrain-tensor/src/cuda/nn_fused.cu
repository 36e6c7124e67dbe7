// cuda/nn_fused.cu: backward kernels of softmax, layer norm and cross-entropy (nn_fused.h).
// One block per row, fp32 math (double for float64).  Layer norm's dweight / dbias are reduced
// deterministically: each block accumulates its rows' partial sums per column (each column owned
// by one thread at a time, barriers between rows), writes them to a scratch tensor, and a second
// kernel sums the partials over blocks in a fixed order; no float atomics anywhere.  Each kernel
// keeps a simple reference version (_v1); BT_CUDA_NN_V1=1 selects them.  Layer norm backward also
// has _v3 (one warp per row, rows up to 1024 elements in registers, per-warp shared-memory
// dweight / dbias partials), _v4 (several warps a row, partials in registers), _v5 (a group of
// warps per row, partials in shared memory; its next-row prefetch measured slower and is off in
// the library) and _v6 (rows through a per-group cp.async shared-memory ring, partials in
// registers; optionally one launch on sm_90: the partials summed across a thread-block cluster
// through distributed shared memory, then over clusters by the last block to arrive, measured
// slower than the reduce kernel and off in the library).  v3-v5
// partials are summed by layernorm_backward_reduce_v4 (many blocks; the serial one-thread-per-
// column reduce, ceil(2C / 256) blocks, stays for v2).  All of them are deterministic for a given
// grid.  Which one runs (nn_common.cuh's version switch; each falls back to the next that applies:
// 16-bit / fp32 rows of whole 16-byte vectors, aligned, and not too long):
//   BT_CUDA_NN_VERSION unset: ln_bwd_default: v6 on sm_80+ (kV6Default; measured best in every
//     bf16 / fp32 case of ln_bwd_check.sh); without it fp32 v5, 16-bit v5 for C <= 1024 with
//     extra, v3 for C <= 1024, v4 for longer rows.
//   1: v1.  2: v2.  3: v3 -> v2.  4: v4 -> v3 -> v2.
//   5: v5 -> (v4 for C > 1024) -> v3 -> v2.  6: v6 (sm_80+; clusters on sm_90+) -> the default
//     without v6.
// bench/ln_bwd_check.sh checks every variant against float64 and times them next to a D2D copy.
// Launchers are left out under BT_NN_FUSED_KERNELS_ONLY (the harness).
//
// Cross-entropy backward reads the logits in their dtype and writes dlogits in that dtype in one
// pass (p = exp(x - lse) from the saved lse; no float32 copy).  Logits rows may be strided; with
// num_classes < the row width (a padded vocabulary) the padding columns get zero gradient, so the
// padded (N, Vp) gradient is written directly.  Each element is read and written
// by the same thread in the same step, so the kernel is safe with dlogits aliasing the logits.
// Version 3 (default, 16-bit / fp32, rows sharing the output's 16-byte alignment):
// crossentropy_backward_v3 (unrolled streaming loads / stores, exp as FFMA + MUFU ex2).
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "../autocast.h"  // cuda::column_sums_any
#include "../backend.h"
#include "../nn_fused.h"
#include "common.cuh"
#include "nn_common.cuh"

namespace bt {
namespace cuda::nn {

// ================================ kernels =======================================================

// ---- softmax backward ------------------------------------------------------------------------
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

template <typename T, int V>
__global__ void softmax_backward_v2(const T* __restrict__ y, const T* __restrict__ dy,
                                    T* __restrict__ dx, int64_t C, bool lg) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const int64_t off = blockIdx.x * C;
  const T *yp = y + off, *gp = dy + off;
  A s = 0;
  row_chunks<V>(yp, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A yv[N], gv[N];
    load_n<N>(gp + i, gv);
    if (!lg) load_n<N>(yp + i, yv);
#pragma unroll
    for (int k = 0; k < N; ++k) s += lg ? gv[k] : gv[k] * yv[k];
  });
  s = block_sum(s, scratch);
  row_chunks<V>(yp, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A yv[N], gv[N];
    load_n<N>(gp + i, gv);
    load_n<N>(yp + i, yv);
#pragma unroll
    for (int k = 0; k < N; ++k) gv[k] = lg ? gv[k] - exp(yv[k]) * s : yv[k] * (gv[k] - s);
    store_n<N>(dx + off + i, gv);
  });
}

// ---- layer norm backward ---------------------------------------------------------------------
// Where dweight / dbias go: T, or float32 (f32) for 16-bit rows whose weight is a cast of a
// float32 master (the column sums are float32 already; one rounding fewer and no widening kernel,
// Note [cached casts]).  Either pointer may be null (that gradient is not wanted).
template <typename T>
struct LnGrads {
  void* dw = nullptr;
  void* db = nullptr;
  bool f32 = false;
  void* ds = nullptr;  // v6 only: the column sums of dx (Note [residual bias]); same dtype rule
  __host__ __device__ bool any() const { return dw || db || ds; }
  // element c of dweight (seg 0), dbias (1) or dsum (2)
  template <typename A>
  __device__ __forceinline__ void put(int seg, int64_t c, A v) const {
    void* p = seg == 0 ? dw : (seg == 1 ? db : ds);
    if (!p) return;
    if (f32) {
      static_cast<float*>(p)[c] = static_cast<float>(v);
    } else {
      static_cast<T*>(p)[c] = convert<T>(v);
    }
  }
  // element j of [dweight | dbias]
  template <typename A>
  __device__ __forceinline__ void put_joined(int64_t j, int64_t C, A v) const {
    put(j >= C ? 1 : 0, j < C ? j : j - C, v);
  }
};

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ extra), g = dy * w, xhat = (x-mean)*rstd.
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

// v2: a grid of G blocks, block b takes rows b, b + G, ...; dx as v1 but vectorised, and the
// block's dweight / dbias partials accumulate in `acc` (shared memory when 2C fit, else the
// block's slice of `partial`), then go to partial[b * 2C ...] for layernorm_backward_reduce.
template <typename T, typename S, int V, bool kSmem>
__global__ void layernorm_backward_v2(const T* __restrict__ dy, const T* __restrict__ x,
                                      const T* __restrict__ w, const S* __restrict__ mean,
                                      const S* __restrict__ rstd, const T* __restrict__ extra,
                                      T* __restrict__ dx, math_t<T>* __restrict__ partial,
                                      int64_t R, int64_t C, bool need_acc) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* acc = kSmem ? reinterpret_cast<A*>(smem_raw) : partial + blockIdx.x * 2 * C;
  if (need_acc) {
    for (int64_t i = threadIdx.x; i < 2 * C; i += blockDim.x) acc[i] = 0;
  }
  // No barrier needed here: the first row's block_sum barriers come before any acc update.
  for (int64_t row = blockIdx.x; row < R; row += gridDim.x) {
    const int64_t off = row * C;
    const A m = mean[row], rs = rstd[row];
    A s1 = 0, s2 = 0;
    row_chunks<V>(x + off, C, [&](int64_t i, auto n) {
      constexpr int N = decltype(n)::value;
      A g[N], xv[N], wv[N];
      load_n<N>(dy + off + i, g);
      load_n<N>(x + off + i, xv);
      if (w) load_n<N>(w + i, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const A gx = w ? g[k] * wv[k] : g[k];
        s1 += gx;
        s2 += gx * (xv[k] - m) * rs;
      }
    });
    s1 = block_sum(s1, scratch) / A(C);
    s2 = block_sum(s2, scratch) / A(C);
    row_chunks<V>(x + off, C, [&](int64_t i, auto n) {
      constexpr int N = decltype(n)::value;
      A g[N], xv[N], wv[N], ev[N], o[N];
      load_n<N>(dy + off + i, g);
      load_n<N>(x + off + i, xv);
      if (w) load_n<N>(w + i, wv);
      if (extra) load_n<N>(extra + off + i, ev);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const A xh = (xv[k] - m) * rs;
        const A gx = w ? g[k] * wv[k] : g[k];
        o[k] = rs * (gx - s1 - xh * s2);
        if (extra) o[k] += ev[k];
        if (need_acc) {
          acc[i + k] += g[k] * xh;
          acc[C + i + k] += g[k];
        }
      }
      store_n<N>(dx + off + i, o);
    });
  }
  if (kSmem && need_acc) {
    __syncthreads();
    A* dst = partial + blockIdx.x * 2 * C;
    for (int64_t i = threadIdx.x; i < 2 * C; i += blockDim.x) dst[i] = acc[i];
  }
}

// v3: one warp per row, rows b * W + w, b * W + w + G * W, ... (G blocks of W warps); dy, x (and
// the weight, loaded once per warp) in registers, so dy and x are read once and dx written once.
// dweight / dbias partials: each warp accumulates its rows into its own shared-memory slice (each
// lane owns its columns: no races), then the block sums its warps' slices in warp order into
// partial[block] for layernorm_backward_reduce.  Deterministic for a given grid.
template <typename T, typename S, int V, int NV>
__global__ void layernorm_backward_v3(const T* __restrict__ dy, const T* __restrict__ x,
                                      const T* __restrict__ w, const S* __restrict__ mean,
                                      const S* __restrict__ rstd, const T* __restrict__ extra,
                                      T* __restrict__ dx, float* __restrict__ partial, int64_t R,
                                      int64_t C, bool need_acc) {
  static_assert(V % 4 == 0, "v3 accumulates float4s");
  using A = float;  // v3 runs for 16-bit and fp32 inputs only
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  A* acc = reinterpret_cast<A*>(smem_raw) + warp * 2 * C;  // this warp's [dw | db] slice
  if (need_acc) {
    for (int64_t i = lane * 4; i < 2 * C; i += 128) {
      *reinterpret_cast<float4*>(acc + i) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncwarp();
  }
  A wv[NV][V];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
#pragma unroll
    for (int k = 0; k < V; ++k) wv[j][k] = A(1);
    if (w && c < C) load_n<V>(w + c, wv[j]);
  }
  for (int64_t row = int64_t(blockIdx.x) * nw + warp; row < R; row += int64_t(gridDim.x) * nw) {
    const int64_t off = row * C;
    const A m = mean[row], rs = rstd[row];
    A g[NV][V], xh[NV][V];
    A s1 = 0, s2 = 0;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v3_col<V>(j, lane);
      if (c < C) {
        load_n<V>(dy + off + c, g[j]);
        load_n<V>(x + off + c, xh[j]);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          xh[j][k] = (xh[j][k] - m) * rs;
          const A gx = g[j][k] * wv[j][k];
          s1 += gx;
          s2 += gx * xh[j][k];
        }
      }
    }
    s1 = warp_sum(s1) / A(C);
    s2 = warp_sum(s2) / A(C);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v3_col<V>(j, lane);
      if (c < C) {
        A o[V], ev[V];
        if (extra) load_n<V>(extra + off + c, ev);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          o[k] = rs * (g[j][k] * wv[j][k] - s1 - xh[j][k] * s2);
          if (extra) o[k] += ev[k];
        }
        store_n<V>(dx + off + c, o);
        if (need_acc) {
#pragma unroll
          for (int k = 0; k < V; k += 4) {
            float4* pw = reinterpret_cast<float4*>(acc + c + k);
            float4* pb = reinterpret_cast<float4*>(acc + C + c + k);
            float4 a = *pw, bb = *pb;
            a.x += g[j][k] * xh[j][k];
            a.y += g[j][k + 1] * xh[j][k + 1];
            a.z += g[j][k + 2] * xh[j][k + 2];
            a.w += g[j][k + 3] * xh[j][k + 3];
            bb.x += g[j][k];
            bb.y += g[j][k + 1];
            bb.z += g[j][k + 2];
            bb.w += g[j][k + 3];
            *pw = a;
            *pb = bb;
          }
        }
      }
    }
  }
  if (need_acc) {
    __syncthreads();
    const A* all = reinterpret_cast<const A*>(smem_raw);
    float* dst = partial + int64_t(blockIdx.x) * 2 * C;
    for (int64_t i = threadIdx.x; i < 2 * C; i += blockDim.x) {
      A t = 0;
      for (int q = 0; q < nw; ++q) t += all[q * 2 * C + i];  // warp order: deterministic
      dst[i] = t;
    }
  }
}

// dweight[c] = sum_b partial[b][c], dbias[c] = sum_b partial[b][C + c], b in order.
template <typename T>
__global__ void layernorm_backward_reduce(const math_t<T>* __restrict__ partial, int G, int64_t C,
                                          LnGrads<T> grads) {
  using A = math_t<T>;
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= 2 * C) return;
  A s = 0;
  for (int b = 0; b < G; ++b) s += partial[b * 2 * C + j];
  grads.put_joined(j, C, s);
}

// v4: one pass over dy and x (mean / rstd saved) on a persistent grid of G blocks of kV4BwdWarps
// warps; a group of WPR warps per row (nn_common.cuh), rows base + group with base stepping by
// G * (kV4BwdWarps / WPR), the same trip count for the whole block (group_sum2's barriers).
// Each lane keeps its columns' dweight / dbias partials in registers across its rows; at the end
// the row groups add theirs into shared memory one group after another (fixed order) and the block
// writes partial[block] (2C floats) for layernorm_backward_reduce_v4.  The weight is re-read per
// row (L1-resident) to save registers.  Deterministic for a given grid.
template <typename T, typename S, int V, int NV, int WPR>
__global__ void __launch_bounds__(kV4BwdWarps * 32, 1)
    layernorm_backward_v4(const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ w, const S* __restrict__ mean,
                          const S* __restrict__ rstd, const T* __restrict__ extra,
                          T* __restrict__ dx, float* __restrict__ partial, int64_t R, int64_t C,
                          bool need_acc) {
  using A = float;                       // v4 runs for 16-bit and fp32 inputs only
  constexpr int RG = kV4BwdWarps / WPR;  // row groups per block
  __shared__ float red[2][2 * kV4BwdWarps];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, grp = warp / WPR;
  const int gl = (warp % WPR) * 32 + lane;
  A aw[NV][V], ab[NV][V];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int k = 0; k < V; ++k) aw[j][k] = 0, ab[j][k] = 0;
  }
  int parity = 0;
  for (int64_t base = int64_t(blockIdx.x) * RG; base < R; base += int64_t(gridDim.x) * RG) {
    const int64_t row = base + grp;
    const bool valid = row < R;
    const int64_t off = valid ? row * C : 0;
    const A m = valid ? A(mean[row]) : A(0), rs = valid ? A(rstd[row]) : A(0);
    A g[NV][V], xh[NV][V];
    A s1 = 0, s2 = 0;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (valid && c < C) {
        A wv[V];
        load_n<V>(dy + off + c, g[j]);
        load_n<V>(x + off + c, xh[j]);
        if (w) load_n<V>(w + c, wv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          xh[j][k] = (xh[j][k] - m) * rs;
          aw[j][k] += g[j][k] * xh[j][k];
          ab[j][k] += g[j][k];
          if (w) g[j][k] *= wv[k];  // g is dy * w from here on
          s1 += g[j][k];
          s2 += g[j][k] * xh[j][k];
        }
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    group_sum2<WPR, kV4BwdWarps>(s1, s2, red[parity]);
    parity ^= 1;
    s1 /= A(C);
    s2 /= A(C);
    if (valid) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int64_t c = v4_col<V, WPR>(j, gl);
        if (c < C) {
          A o[V], ev[V];
          if (extra) load_n<V>(extra + off + c, ev);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            o[k] = rs * (g[j][k] - s1 - xh[j][k] * s2);
            if (extra) o[k] += ev[k];
          }
          store_n<V>(dx + off + c, o);
        }
      }
    }
  }
  if (!need_acc) return;
  // Row groups add their partials into acc = [dw | db] in group order; lanes own their columns.
  A* acc = reinterpret_cast<A*>(smem_raw);
  for (int q = 0; q < RG; ++q) {
    if (grp == q) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int64_t c = v4_col<V, WPR>(j, gl);
        if (c < C) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            acc[c + k] = q ? acc[c + k] + aw[j][k] : aw[j][k];
            acc[C + c + k] = q ? acc[C + c + k] + ab[j][k] : ab[j][k];
          }
        }
      }
    }
    __syncthreads();
  }
  float* dst = partial + int64_t(blockIdx.x) * 2 * C;
  for (int64_t i = threadIdx.x * 4; i < 2 * C; i += blockDim.x * 4) {  // 2C % 4 == 0 (C % V)
    *reinterpret_cast<float4*>(dst + i) = *reinterpret_cast<const float4*>(acc + i);
  }
}

// dweight[c] = sum_b partial[b][c], dbias[c] = sum_b partial[b][C + c]: 32 columns per block,
// kReduceRows threads down each column summing blocks ty, ty + kReduceRows, ... in order, then the
// column's kReduceRows sums in order (deterministic; all SMs busy instead of one serial loop).
constexpr int kReduceRows = 16;
template <typename T>
__global__ void __launch_bounds__(32 * kReduceRows)
    layernorm_backward_reduce_v4(const float* __restrict__ partial, int G, int64_t C,
                                 LnGrads<T> grads) {
  __shared__ float sm[kReduceRows][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = blockIdx.x * int64_t(32) + tx;
  float s = 0;
  if (j < 2 * C) {
#pragma unroll 4
    for (int b = ty; b < G; b += kReduceRows) s += partial[int64_t(b) * 2 * C + j];
  }
  sm[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || j >= 2 * C) return;
  float t = 0;
#pragma unroll
  for (int q = 0; q < kReduceRows; ++q) t += sm[q][tx];
  grads.put_joined(j, C, t);
}

// v5: v3 / v4 with more bytes in flight per warp.  A group of WPR warps per row (the smallest WPR
// giving at most kV5MaxNV 16-byte vectors per lane, so GPT-2's 768 and 3072 rows, bf16 and fp32,
// all hold 3 vectors per lane and array), NW warps per block on a persistent grid.  With kPf a
// group issues its next row's loads (dy, x, extra as raw 16-byte words; mean, rstd) before the
// current row's math, so its loads overlap its own shuffles, barrier and stores instead of the
// SM's loads draining at each row's reductions.  Rows stay raw and are unpacked twice (a few ALU
// ops next to the memory time) to leave registers for the prefetch.  The weight sits in shared
// memory as float; dweight / dbias partials accumulate in a per-group shared slice (each group
// lane owns its columns), rows in order; at the end the block sums its groups' slices in group
// order into partial[block] for layernorm_backward_reduce_v4.  kCs: streaming (evict-first) loads
// of dy / x / extra and stores of dx.  Deterministic for a given grid.
constexpr int kV5Warps = 8;  // warps per block (eval_gpu's choice; the check harness tries 16)

template <bool kCs>
__device__ __forceinline__ uint4 ld16(const void* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
  if constexpr (kCs) {
    return __ldcs(q);
  } else {
    return __ldg(q);
  }
}
template <bool kCs>
__device__ __forceinline__ void st16(void* p, const uint4& v) {
  uint4* q = reinterpret_cast<uint4*>(p);
  if constexpr (kCs) {
    __stcs(q, v);
  } else {
    *q = v;
  }
}

template <typename T, typename S, int NV, int WPR, int NW, bool kPf, bool kCs>
__global__ void __launch_bounds__(NW * 32, 16 / NW)  // <= 128 registers: 16 warps per SM
    layernorm_backward_v5(const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ w, const S* __restrict__ mean,
                          const S* __restrict__ rstd, const T* __restrict__ extra,
                          T* __restrict__ dx, float* __restrict__ partial, int64_t R, int64_t C,
                          bool need_acc) {
  constexpr int V = static_cast<int>(16 / sizeof(T)), RG = NW / WPR;
  static_assert(V % 4 == 0, "v5 reads float4s of the weight and partials");
  __shared__ float red[2][2 * NW];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, grp = warp / WPR;
  const int gl = (warp % WPR) * 32 + lane;
  float* wsm = reinterpret_cast<float*>(smem_raw);  // C floats: the weight (1 without one)
  float* acc = wsm + C + int64_t(grp) * 2 * C;      // 2C floats: this group's [dw | db]
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) wsm[i] = w ? load_math(w + i) : 1.f;
  if (need_acc) {
    for (int64_t i = threadIdx.x; i < int64_t(RG) * 2 * C; i += blockDim.x) wsm[C + i] = 0.f;
  }
  __syncthreads();

  const int64_t step = int64_t(gridDim.x) * RG;
  int64_t row = int64_t(blockIdx.x) * RG + grp;  // the group's rows: row, row + step, ...
  auto load_row = [&](int64_t r, uint4(&d)[NV], uint4(&xv)[NV], uint4(&e)[NV], float& m,
                      float& rs) {
    if (r >= R) return;
    const int64_t off = r * C;
    m = static_cast<float>(mean[r]);
    rs = static_cast<float>(rstd[r]);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (c < C) {
        d[j] = ld16<kCs>(dy + off + c);
        xv[j] = ld16<kCs>(x + off + c);
        if (extra) e[j] = ld16<kCs>(extra + off + c);
      }
    }
  };
  uint4 cd[NV], cx[NV], ce[NV];
  float cm = 0.f, cr = 0.f;
  if constexpr (kPf) load_row(row, cd, cx, ce, cm, cr);
  int parity = 0;
  for (; row < R; row += step) {
    uint4 nd[NV], nx[NV], ne[NV];
    float nm = 0.f, nr = 0.f;
    if constexpr (kPf) {
      load_row(row + step, nd, nx, ne, nm, nr);  // in flight during this row's math
    } else {
      load_row(row, cd, cx, ce, cm, cr);
    }
    const int64_t off = row * C;
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (c < C) {
        float g[V], xh[V];
        unpack16<T>(cd[j], g);
        unpack16<T>(cx[j], xh);
#pragma unroll
        for (int k = 0; k < V; k += 4) {
          const float4 wv = *reinterpret_cast<const float4*>(wsm + c + k);
          const float ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            xh[k + q] = (xh[k + q] - cm) * cr;
            const float gw = g[k + q] * ww[q];
            s1 += gw;
            s2 += gw * xh[k + q];
          }
          if (need_acc) {
            float4* pw = reinterpret_cast<float4*>(acc + c + k);
            float4* pb = reinterpret_cast<float4*>(acc + C + c + k);
            float4 a = *pw, b = *pb;
            a.x += g[k] * xh[k];
            a.y += g[k + 1] * xh[k + 1];
            a.z += g[k + 2] * xh[k + 2];
            a.w += g[k + 3] * xh[k + 3];
            b.x += g[k];
            b.y += g[k + 1];
            b.z += g[k + 2];
            b.w += g[k + 3];
            *pw = a;
            *pb = b;
          }
        }
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    group_sum2<WPR, NW>(s1, s2, red[parity]);
    parity ^= 1;
    s1 /= static_cast<float>(C);
    s2 /= static_cast<float>(C);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (c < C) {
        float g[V], xh[V], ev[V], o[V];
        unpack16<T>(cd[j], g);
        unpack16<T>(cx[j], xh);
        if (extra) unpack16<T>(ce[j], ev);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float xhk = (xh[k] - cm) * cr;
          o[k] = cr * (g[k] * wsm[c + k] - s1 - xhk * s2);
          if (extra) o[k] += ev[k];
        }
        st16<kCs>(dx + off + c, pack16<T>(o));
      }
    }
    if constexpr (kPf) {
#pragma unroll
      for (int j = 0; j < NV; ++j) cd[j] = nd[j], cx[j] = nx[j], ce[j] = ne[j];
      cm = nm, cr = nr;
    }
  }
  if (!need_acc) return;
  __syncthreads();
  const float* all = wsm + C;
  float* dst = partial + int64_t(blockIdx.x) * 2 * C;
  for (int64_t i = threadIdx.x * 4; i < 2 * C; i += blockDim.x * 4) {  // 2C % 4 == 0 (C % V)
    float4 t = *reinterpret_cast<const float4*>(all + i);
    for (int q = 1; q < RG; ++q) {  // group order: deterministic
      const float4 u = *reinterpret_cast<const float4*>(all + int64_t(q) * 2 * C + i);
      t.x += u.x, t.y += u.y, t.z += u.z, t.w += u.w;
    }
    *reinterpret_cast<float4*>(dst + i) = t;
  }
}

// Launch geometry of v5 (shared by eval_gpu and bench/ln_bwd_check.cu): dynamic shared memory
// (weight + RG group slices) and the persistent grid, the resident blocks (at most 4 per SM) but
// no more than the row groups need; 0 where the kernel cannot launch (more shared memory than
// smem_optin, the device's per-block opt-in limit).
template <typename T, typename S, int NV, int WPR, int NW, bool kPf, bool kCs>
struct LnBwdV5 {
  static constexpr int kThreadsV5 = NW * 32;
  static size_t smem(int64_t C, bool need_acc) {
    return static_cast<size_t>(C + (need_acc ? int64_t(NW / WPR) * 2 * C : 0)) * sizeof(float);
  }
  static int grid(int64_t R, int64_t C, bool need_acc, int sm_count, size_t smem_optin,
                  const char* op) {
    auto kern = layernorm_backward_v5<T, S, NV, WPR, NW, kPf, kCs>;
    const size_t sm = smem(C, need_acc);
    if (sm > smem_optin) return 0;
    if (sm > 48 * 1024) {
      BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(sm)));
    }
    int per_sm = 0;
    BT_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kThreadsV5, sm));
    if (per_sm == 0) return 0;
    per_sm = std::min(per_sm, 4);
    return static_cast<int>(std::min<int64_t>(ceil_div(R, NW / WPR), int64_t(sm_count) * per_sm));
  }
  static void launch(int G, cudaStream_t st, const T* dy, const T* x, const T* w, const S* mean,
                     const S* rstd, const T* extra, T* dx, float* partial, int64_t R, int64_t C,
                     bool need_acc) {
    layernorm_backward_v5<T, S, NV, WPR, NW, kPf, kCs><<<G, kThreadsV5, smem(C, need_acc), st>>>(
        dy, x, w, mean, rstd, extra, dx, partial, R, C, need_acc);
  }
};

// v6 (aimed at 16-bit rows, where v3-v5 stayed near 64% of copy: a bf16 row carries half an fp32
// row's bytes for the same math, so the loads a warp holds in registers while it computes were
// too few bytes to cover memory latency, and v3 / v5's per-row shared-memory dweight / dbias
// read-modify-writes cost as much L1 bandwidth as the row itself).  Three changes:
//  - rows arrive through a per-group ring of kV6Stages shared-memory slots filled by cp.async
//    (16-byte copies, L2 only): each group keeps its next K - 1 rows in flight while it computes
//    one, with no registers held for them.  Each lane copies and later reads only its own columns
//    (the v4 / v5 layout), so a slot needs no barrier: cp.async.wait_group orders it per thread;
//    lane 0 of each warp copies the row's mean / rstd, read by its warp after a __syncwarp.
//  - dweight / dbias partials in registers over all of a lane's rows (as v4); the weight is
//    kept as raw 16-byte words in registers (unpacked per use: one ALU op for bf16).
//  - one launch on Hopper: blocks form clusters of CL; after the row loop each block puts its
//    partial (its groups' registers summed in group order) in shared memory, block rank r of a
//    cluster sums slice r of [dw | db] over the cluster's blocks in rank order through distributed
//    shared memory and writes it to partial[cluster]; the last block to finish slice r over all
//    clusters (a per-slice arrival counter, reset by that block) sums the slice over the clusters
//    in cluster order and writes dweight / dbias.  CL = 1 (or final_here false) writes the
//    partials for layernorm_backward_reduce_v4 instead.
// Deterministic for a given grid: every sum has a fixed order whichever block arrives last.
// Arrival counters are one per device (a __device__ array): the backward kernels of a device run
// in stream order (Note [streams]), never two at once.
// warps per block and ring slots per row group (K - 1 rows in flight) of the library: one
// 16-warp block per SM, 2 slots measured best for bf16 and fp32, C 768 and 3072, with and
// without extra (ln_bwd_check.sh, session 14: bf16 C 768 79.8% of copy against 75.0% for 8
// warps and 3 slots, 71.0% for 8 and 4; its partials are 132 rows instead of 264)
constexpr int kV6Warps = 16;
constexpr int kV6Stages = 2;
// the partials' reduce as a programmatic dependent launch on sm_90+ (launch_ln_bwd_reduce_v6)
constexpr bool kV6ReducePdl = true;
// blocks per cluster (library: 1, the reduce kernel; 8 on sm_90 measured 57.5% of copy against
// 68.5% at bf16 16384 x 768, ln_bwd_check.sh, session 12)
constexpr int kV6Cluster = 1;
constexpr int kV6MaxCluster = 16;  // 16 needs the non-portable cluster size attribute
constexpr int kV6MaxBlocksPerSm = 4;
__device__ unsigned int g_ln_bwd_v6_arrivals[kV6MaxCluster];

__device__ __forceinline__ float4 f4_add(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Float4 i of [dw | db (| ds)] (C % 4 == 0: never straddles two) converted and stored.
template <typename T>
__device__ __forceinline__ void ln_store_dwdb4(int64_t i, float4 s, int64_t C,
                                               const LnGrads<T>& grads) {
  const int64_t e = i * 4;
  const int seg = static_cast<int>(e / C);
  const int64_t c = e - seg * C;
  grads.put(seg, c, s.x);
  grads.put(seg, c + 1, s.y);
  grads.put(seg, c + 2, s.z);
  grads.put(seg, c + 3, s.w);
}

// Sums float4 columns [a, b) of partial rows 0..P-1 (row stride n4 float4s) in a fixed order and
// stores them to dw / db: QS threads per column take rows sub, sub + QS, ... (independent loads
// in flight), then one thread adds the QS sums in order.  buf: blockDim.x float4s of shared
// memory.  Every thread of the block calls it.  __ldcg: the partials were written by other blocks
// during this kernel (L2 is coherent, L1 is not).
template <typename T>
__device__ void ln_bwd_final_slice(const float4* partial, int P, int64_t n4, int64_t a, int64_t b,
                                   int64_t C, float4* buf, const LnGrads<T>& grads) {
  const int t = threadIdx.x, nt = blockDim.x;
  const int n = static_cast<int>(b - a);
  if (n <= 0) return;
  const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
  if (n >= nt) {
    for (int i = t; i < n; i += nt) {
      float4 s = z;
#pragma unroll 4
      for (int p = 0; p < P; ++p) s = f4_add(s, __ldcg(partial + p * n4 + a + i));
      ln_store_dwdb4(a + i, s, C, grads);
    }
    return;
  }
  const int QS = nt / n;
  if (t < QS * n) {
    const int i = t % n, sub = t / n;
    float4 s = z;
#pragma unroll 4
    for (int p = sub; p < P; p += QS) s = f4_add(s, __ldcg(partial + p * n4 + a + i));
    buf[sub * n + i] = s;
  }
  __syncthreads();
  if (t < n) {
    float4 s = buf[t];
    for (int q = 1; q < QS; ++q) s = f4_add(s, buf[q * n + t]);
    ln_store_dwdb4(a + t, s, C, grads);
  }
}

// dweight / dbias from P partial rows of [dw | db] (n4 = C / 2 float4s each; v6's partials):
// kRedCols float4 columns per block, kRedPhases threads down each column summing rows ph,
// ph + kRedPhases, ... (all loads of a thread in flight at once for P <= 8 kRedPhases), then the
// column's phase sums in order (deterministic).  Measured (ln_bwd_check.sh, session 14, bf16
// 16384 x 768 after v6 nw16 k2): level with reduce_v4 launched plainly (78.2-78.7% of copy
// against 79.0-79.4%); launched as a programmatic dependent 80.7%.
constexpr int kRedCols = 16, kRedPhases = 32;
template <typename T>
__global__ void __launch_bounds__(kRedCols* kRedPhases)
    layernorm_backward_reduce_v6(const float4* __restrict__ partial, int P, int64_t n4, int64_t C,
                                 LnGrads<T> grads) {
  __shared__ float4 sums[kRedPhases][kRedCols];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent (launch_ln_bwd_reduce_v6): wait here until the row
  // kernel has finished and its partials are visible (a no-op in an ordinary launch).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  const int tx = threadIdx.x % kRedCols, ph = threadIdx.x / kRedCols;
  const int64_t j = blockIdx.x * int64_t(kRedCols) + tx;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  if (j < n4) {
#pragma unroll 8
    for (int b = ph; b < P; b += kRedPhases) s = f4_add(s, __ldcg(partial + b * n4 + j));
  }
  sums[ph][tx] = s;
  __syncthreads();
  if (ph != 0 || j >= n4) return;
#pragma unroll
  for (int q = 1; q < kRedPhases; ++q) s = f4_add(s, sums[q][tx]);
  ln_store_dwdb4(j, s, C, grads);
}
// pdl (compute capability 9+): launched as a programmatic dependent of the row kernel before it
// (cudaLaunchAttributeProgrammaticStreamSerialization), so its blocks are resident and waiting
// when the row kernel ends instead of launching after it.
template <typename T>
void launch_ln_bwd_reduce_v6(const float* partial, int P, int64_t C, LnGrads<T> grads,
                             cudaStream_t st, bool pdl, const char* op) {
  const int64_t n4 = (grads.ds ? 3 : 2) * C / 4;  // float4s of [dw | db (| ds)]
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at;
  cfg.gridDim = dim3(static_cast<unsigned>(ceil_div(n4, int64_t(kRedCols))));
  cfg.blockDim = dim3(kRedCols * kRedPhases);
  cfg.stream = st;
  if (pdl) {
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &at;
    cfg.numAttrs = 1;
  }
  BT_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, layernorm_backward_reduce_v6<T>,
                                       reinterpret_cast<const float4*>(partial), P, n4, C, grads));
}

template <typename T, typename S, int NV, int WPR, int NW, int K, int CL>
__global__ void __launch_bounds__(NW * 32, (NW >= 16 ? 1 : 16 / NW))  // <= 128 registers
    layernorm_backward_v6(const T* __restrict__ dy, const T* __restrict__ x,
                          const T* __restrict__ w, const S* __restrict__ mean,
                          const S* __restrict__ rstd, const T* __restrict__ extra,
                          T* __restrict__ dx, float* __restrict__ partial, LnGrads<T> grads,
                          int64_t R, int64_t C, bool need_acc, bool final_here) {
  constexpr int V = static_cast<int>(16 / sizeof(T)), RG = NW / WPR;
  static_assert(V % 4 == 0 && sizeof(S) == 4, "v6: 16-bit / fp32 rows, float statistics");
  static_assert(K >= 2 && CL >= 1 && CL <= kV6MaxCluster, "v6 configuration");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // cp.async: sm_80+ (the host launches v6 only there)
#else
  __shared__ float red[2][2 * NW];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, grp = warp / WPR;
  const int gl = (warp % WPR) * 32 + lane;
  // Ring of this group: K slots of [dy | x (| extra)] rows (C * sizeof(T) % 16 == 0, C % V);
  // stats: this warp's (mean, rstd) per slot.  Byte offsets in shared memory.
  const unsigned row_bytes = static_cast<unsigned>(C * sizeof(T));
  const unsigned slot_bytes = (extra ? 3u : 2u) * row_bytes;
  const unsigned ring = smem_addr(smem_raw) + unsigned(grp) * K * slot_bytes;
  const unsigned stats = smem_addr(smem_raw) + unsigned(RG) * K * slot_bytes + warp * K * 8;
  // Note [residual bias]: with grads.ds, this group's column sums of dx (as stored) accumulate in
  // shared memory past the ring, the stats and the end's slices (the registers are full at
  // C = 768: 125 of 128); a lane owns its columns in its group, so no barrier is needed.
  const int nseg = grads.ds ? 3 : 2;
  float* dsa = nullptr;
  if (grads.ds) {
    const size_t ring_stats = size_t(RG) * K * slot_bytes + size_t(NW) * K * 8;
    const size_t off = ring_stats > size_t(RG) * 12 * C ? ring_stats : size_t(RG) * 12 * C;
    dsa = reinterpret_cast<float*>(smem_raw + off) + int64_t(grp) * C;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (c < C) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
          *reinterpret_cast<float4*>(dsa + c + k) = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    }
  }

  uint4 wr[NV];  // the weight's raw words (1 without a weight)
  float aw[NV][V], ab[NV][V];
  {
    float one[V];
#pragma unroll
    for (int k = 0; k < V; ++k) one[k] = 1.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      wr[j] = w && c < C ? __ldg(reinterpret_cast<const uint4*>(w + c)) : pack16<T>(one);
#pragma unroll
      for (int k = 0; k < V; ++k) aw[j][k] = 0.f, ab[j][k] = 0.f;
    }
  }

  const int64_t step = int64_t(gridDim.x) * RG;
  const int64_t row0 = int64_t(blockIdx.x) * RG + grp;  // the group's rows: row0 + i * step
  // Copies row r (if any) into slot `slot`, then commits a group (empty past the last row, so
  // every thread's group count stays in step with the loop).
  auto issue = [&](int64_t r, int slot) {
    if (r < R) {
      ring_copy_row<V, NV, WPR>(ring + slot * slot_bytes, row_bytes, r * C, C, gl, dy, x, extra);
      if (lane == 0) {
        async_copy4(stats + slot * 8, mean + r);
        async_copy4(stats + slot * 8 + 4, rstd + r);
      }
    }
    async_commit();
  };
#pragma unroll
  for (int k = 0; k < K - 1; ++k) issue(row0 + k * step, k);

  int slot = 0, parity = 0;
  // Every row group runs the block's trip count (that of group 0), idle past R, so that
  // group_sum2's named barriers pair up alike in every group (compute-sanitizer's racecheck
  // reported the final __syncthreads-ordered accumulation as racing when they did not).
  for (int64_t base = row0 - grp; base < R; base += step) {
    const int64_t row = base + grp;
    const bool live = row < R;
    __syncwarp();  // the warp is done with the slot refilled next (lane 0 rewrites its stats)
    issue(row + (K - 1) * step, slot == 0 ? K - 1 : slot - 1);
    async_wait<K - 1>();  // this row's copies (this thread's) landed
    __syncwarp();         // lane 0's mean / rstd visible to the warp
    const unsigned sl = ring + slot * slot_bytes;
    const float2 st = lds8f(stats + slot * 8);
    const float m = st.x, rs = st.y;
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (live && c < C) {
        const unsigned cb = static_cast<unsigned>(c * sizeof(T));
        float g[V], xh[V], wv[V];
        unpack16<T>(lds16(sl + cb), g);
        unpack16<T>(lds16(sl + row_bytes + cb), xh);
        unpack16<T>(wr[j], wv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          xh[k] = (xh[k] - m) * rs;
          const float gw = g[k] * wv[k];
          s1 += gw;
          s2 += gw * xh[k];
          if (need_acc) {
            aw[j][k] += g[k] * xh[k];
            ab[j][k] += g[k];
          }
        }
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    group_sum2<WPR, NW>(s1, s2, red[parity]);
    parity ^= 1;
    s1 /= static_cast<float>(C);
    s2 /= static_cast<float>(C);
    const int64_t off = row * C;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (live && c < C) {  // the slot again (shared memory reads are cheap; registers are not)
        const unsigned cb = static_cast<unsigned>(c * sizeof(T));
        float g[V], xh[V], wv[V], ev[V], o[V];
        unpack16<T>(lds16(sl + cb), g);
        unpack16<T>(lds16(sl + row_bytes + cb), xh);
        unpack16<T>(wr[j], wv);
        if (extra) unpack16<T>(lds16(sl + 2 * row_bytes + cb), ev);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          o[k] = rs * (g[k] * wv[k] - s1 - (xh[k] - m) * rs * s2);
          if (extra) o[k] += ev[k];
        }
        const uint4 packed = pack16<T>(o);
        *reinterpret_cast<uint4*>(dx + off + c) = packed;
        if (dsa) {  // the stored (rounded) values, as column sums of dx would read them
          float q[V];
          unpack16<T>(packed, q);
#pragma unroll
          for (int k = 0; k < V; k += 4) {
            float4* a = reinterpret_cast<float4*>(dsa + c + k);
            const float4 t = *a;
            *a = make_float4(t.x + q[k], t.y + q[k + 1], t.z + q[k + 2], t.w + q[k + 3]);
          }
        }
      }
    }
    slot = slot + 1 == K ? 0 : slot + 1;
  }
  async_wait<0>();  // the (empty or unused) groups still pending
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // a programmatic dependent (the partials' reduce) may launch now; it waits for this grid's end
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  if (!need_acc) return;

  // Block partial acc = [dw | db (| ds)]: each group puts its nseg C floats in its slice (over
  // the ring), then each float4 column is summed over the slices in group order into slice 0
  // (one barrier; a barrier per group measured slower).
  __syncthreads();
  float* acc = reinterpret_cast<float*>(smem_raw);
  {
    float* mine = acc + int64_t(grp) * nseg * C;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (c < C) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
          *reinterpret_cast<float4*>(mine + c + k) =
              make_float4(aw[j][k], aw[j][k + 1], aw[j][k + 2], aw[j][k + 3]);
          *reinterpret_cast<float4*>(mine + C + c + k) =
              make_float4(ab[j][k], ab[j][k + 1], ab[j][k + 2], ab[j][k + 3]);
          if (dsa) {
            *reinterpret_cast<float4*>(mine + 2 * C + c + k) =
                *reinterpret_cast<const float4*>(dsa + c + k);
          }
        }
      }
    }
  }
  __syncthreads();
  const int64_t n4 = nseg * C / 4;  // float4s of [dw | db (| ds)]
  if constexpr (RG > 1) {
    float4* a4 = reinterpret_cast<float4*>(acc);
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) {
      float4 t = a4[i];
#pragma unroll
      for (int q = 1; q < RG; ++q) t = f4_add(t, a4[q * n4 + i]);
      a4[i] = t;
    }
    __syncthreads();
  }
  const float4* acc4 = reinterpret_cast<const float4*>(acc);
  if constexpr (CL == 1) {
    float4* dst = reinterpret_cast<float4*>(partial) + int64_t(blockIdx.x) * n4;
    for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) dst[i] = acc4[i];
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    __shared__ unsigned last_flag;  // this block finished its slice last
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    const int64_t a = n4 * rank / CL, b = n4 * (rank + 1) / CL;  // this block's slice
    cluster.sync();  // every block's partial is in its shared memory
    const float4* peer[CL];
#pragma unroll
    for (int q = 0; q < CL; ++q) peer[q] = cluster.map_shared_rank(acc4, q);
    float4* dst = reinterpret_cast<float4*>(partial) + int64_t(blockIdx.x / CL) * n4;
    for (int64_t i = a + threadIdx.x; i < b; i += blockDim.x) {
      float4 t = peer[0][i];
#pragma unroll
      for (int q = 1; q < CL; ++q) t = f4_add(t, peer[q][i]);  // rank order
      dst[i] = t;
    }
    // done reading the peers' shared memory; wait (below) before exiting, as they read ours
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    if (final_here) {
      const unsigned P = gridDim.x / CL;
      __threadfence();  // this block's slice of partial[cluster] before its arrival
      __syncthreads();
      if (threadIdx.x == 0) last_flag = atomicAdd(&g_ln_bwd_v6_arrivals[rank], 1u) == P - 1;
      __syncthreads();
      if (last_flag) {  // every cluster's slice `rank` is written
        __threadfence();
        ln_bwd_final_slice<T>(reinterpret_cast<const float4*>(partial), static_cast<int>(P), n4, a,
                              b, C, reinterpret_cast<float4*>(acc + nseg * C), grads);
        if (threadIdx.x == 0) g_ln_bwd_v6_arrivals[rank] = 0;  // ready for the next launch
      }
    }
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();  // clusters: sm_90+ (the host launches CL > 1 only there)
#endif
  }
#endif
}

// Launch geometry of v6 (shared by eval_gpu and bench/ln_bwd_check.cu).  Shared memory: the rings
// and stats during the row loop, then the groups' [dw | db] slices (2C floats each), summed into
// the block partial (slice 0), and the final slice buffer (one float4 per thread) at the end. Grid:
// the resident blocks (at most kV6MaxBlocksPerSm per SM; whole clusters as
// cudaOccupancyMaxActiveClusters allows), no more than the row groups need (rounded up to whole
// clusters); 0 where it cannot launch (compute capability below 8, or 9 for clusters, or more
// shared memory than smem_optin).
template <typename T, typename S, int NV, int WPR, int NW, int K, int CL>
struct LnBwdV6 {
  static constexpr int kThreads = NW * 32, kRG = NW / WPR, kCluster = CL;
  static auto kernel() { return layernorm_backward_v6<T, S, NV, WPR, NW, K, CL>; }
  static size_t smem(int64_t C, bool extra, bool ds = false) {
    const size_t ring = size_t(kRG) * K * (extra ? 3 : 2) * size_t(C) * sizeof(T);
    const size_t stats = size_t(NW) * K * 2 * sizeof(float);
    const size_t nseg = ds ? 3 : 2;
    // the groups' [dw | db (| ds)] slices, then the block partial (slice 0) and the final slice
    // buffer; with ds, the groups' dx column sums past both the ring and the slices (the kernel
    // computes the same offset)
    const size_t slices = size_t(kRG) * nseg * C * sizeof(float);
    const size_t tail = nseg * C * sizeof(float) + size_t(kThreads) * 16;
    if (ds) {
      const size_t dsa = size_t(kRG) * C * sizeof(float);
      return std::max(std::max(ring + stats, slices) + dsa, tail);
    }
    return std::max({ring + stats, slices, tail});
  }
  static void set_cluster(cudaLaunchConfig_t& cfg, cudaLaunchAttribute& at) {
    at.id = cudaLaunchAttributeClusterDimension;
    at.val.clusterDim.x = CL;
    at.val.clusterDim.y = 1;
    at.val.clusterDim.z = 1;
    cfg.attrs = &at;
    cfg.numAttrs = 1;
  }
  static int grid(int64_t R, int64_t C, bool extra, int sm_count, size_t smem_optin, int major,
                  const char* op, bool ds = false) {
    auto kern = kernel();
    const size_t sm = smem(C, extra, ds);
    if (major < 8 || (CL > 1 && major < 9) || sm > smem_optin) return 0;
    BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sm)));
    if constexpr (CL > 8) {
      BT_CUDA_CHECK(op,
                    cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    }
    int per_sm = 0;
    BT_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kThreads, sm));
    per_sm = std::min(per_sm, kV6MaxBlocksPerSm);
    int64_t cap = int64_t(sm_count) * per_sm;
    const int64_t need = ceil_div(R, int64_t(kRG));
    if constexpr (CL > 1) {
      cudaLaunchConfig_t cfg = {};
      cudaLaunchAttribute at;
      cfg.gridDim =
          dim3(static_cast<unsigned>(ceil_div(std::max<int64_t>(cap, 1), int64_t(CL)) * CL));
      cfg.blockDim = dim3(kThreads);
      cfg.dynamicSmemBytes = sm;
      set_cluster(cfg, at);
      int clusters = 0;
      BT_CUDA_CHECK(op, cudaOccupancyMaxActiveClusters(&clusters, kern, &cfg));
      cap = std::min<int64_t>(cap, int64_t(clusters) * CL) / CL * CL;
      return static_cast<int>(std::min<int64_t>(ceil_div(need, int64_t(CL)) * CL, cap));
    }
    return static_cast<int>(std::min<int64_t>(need, cap));
  }
  // final_here (CL > 1): dweight / dbias written by the kernel; else G / CL (CL > 1) or G
  // partials are left for layernorm_backward_reduce_v4.
  static void launch(int G, cudaStream_t st, const T* dy, const T* x, const T* w, const S* mean,
                     const S* rstd, const T* extra, T* dx, float* partial, LnGrads<T> grads,
                     int64_t R, int64_t C, bool need_acc, bool final_here, const char* op) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at;
    cfg.gridDim = dim3(static_cast<unsigned>(G));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem(C, extra != nullptr, grads.ds != nullptr);
    cfg.stream = st;
    if constexpr (CL > 1) set_cluster(cfg, at);
    BT_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, kernel(), dy, x, w, mean, rstd, extra, dx, partial,
                                         grads, R, C, need_acc, CL > 1 && final_here));
  }
};

// The layer-norm backward kernel LayerNormBackward::eval_gpu runs with BT_CUDA_NN_VERSION unset,
// for T rows of C (with `extra`: add_layer_norm's residual gradient) on a device of compute
// capability `major`; with_v6 false: the choice when v6 does not apply.  H200, R = 16384, GPT-2's
// C (bench/RESULTS.md session 11, % of a D2D copy, dw / db reduce included): fp32: v5 (nw8, no
// prefetch) 84-92% against v3 / v4's 57-73%; bf16 C = 768 + extra: v5 74% against v3's 64%;
// bf16 otherwise v3 (C <= kV4MinDefaultC) or v4 (longer rows), v5 within 2%.  16-bit on sm_90+:
// v6 when kV6Default (ln_bwd_check.sh, session 12: v6 with the reduce kernel was the best variant
// for bf16 and fp32, C 768 and 3072, with and without extra; false: the v5 / v3 / v4 choice).  The
// launcher falls back down v6 -> v5 -> v4 -> v3 -> v2 where a kernel does not apply (double,
// misaligned pointers, rows not whole 16-byte vectors or too long).
constexpr bool kV6Default = true;
template <typename K>
struct ln_tag {  // a type as a value (for generic lambdas)
  using type = K;
};
template <typename T>
inline int ln_bwd_default(int64_t C, bool extra, int major, bool with_v6 = true) {
  if (kV6Default && with_v6 && major >= 8) return 6;
  if (sizeof(T) == 4) return 5;
  if (sizeof(T) == 2 && extra && C <= kV4MinDefaultC) return 5;
  return C > kV4MinDefaultC ? 4 : 3;
}

// ---- cross-entropy backward ------------------------------------------------------------------
// scale[r] = 0 for ignored rows, else g[r] (none), g[0] / #valid (mean), g[0] (sum).  One block.
template <typename G, typename A>
__global__ void crossentropy_row_scale(const int64_t* __restrict__ t, const G* __restrict__ g,
                                       int64_t N, int64_t ii, int reduction,
                                       A* __restrict__ scale) {
  __shared__ A scratch[32];
  A cnt = 0;
  if (reduction == 1) {
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) cnt += t[i] != ii;
    cnt = block_sum(cnt, scratch);
  }
  const A g0 = reduction == 0 ? A(0) : convert<A>(g[0]);
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    A s = reduction == 0 ? convert<A>(g[i]) : reduction == 1 ? g0 / cnt : g0;
    scale[i] = t[i] == ii ? A(0) : s;
  }
}

// d = (exp(x - lse) - ls / C - (i == target) * (1 - ls)) * scale[row]; ignored rows 0, an
// out-of-range target NaN.  Logits rows start ldx elements apart; dlogits is (N, Cx) dense and its
// columns >= C (a padded vocabulary's padding) get 0, so it is the padded gradient in one pass.
// x is not __restrict__: dx may be x (Note [donating a saved input]); each thread reads an
// element before it writes it.
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

// v2: chunks follow the output row (16-byte stores); the host launches V > 1 only when each
// logits row has the same 16-byte alignment as its output row (same base alignment and
// (ldx - Cx) * sizeof(T) a multiple of 16), so the loads at the same column are aligned too.
// A chunk straddling column C loads columns < Cx <= ldx (in bounds) and discards those >= C.
template <typename T, typename S, int V>
__global__ void crossentropy_backward_v2(const T* x, int64_t ldx, const int64_t* __restrict__ t,
                                         const S* __restrict__ lse, const math_t<T>* scale, T* dx,
                                         int64_t C, int64_t Cx, int64_t ii, double ls) {
  using A = math_t<T>;
  const int64_t row = blockIdx.x, tg = t[row];
  const A l = lse[row], sc = scale[row], offv = A(ls / double(C)), on = A(1 - ls);
  const bool ign = tg == ii, bad = !ign && (tg < 0 || tg >= C);
  const T* p = x + row * ldx;
  T* q = dx + row * Cx;
  row_chunks<V>(q, Cx, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N];
    if (ign || i >= C) {
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = 0;
    } else {
      load_n<N>(p + i, v);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        A d = exp(v[k] - l) - offv;
        if (i + k == tg) d -= on;
        v[k] = i + k >= C ? A(0) : bad ? A(NAN) : d * sc;
      }
    }
    store_n<N>(q + i, v);
  });
}

// v3: as v2 with the forward v3's machinery: kCeUnroll 16-byte streaming loads in flight per
// thread, exp(x - lse) as one FFMA + MUFU ex2 (2^(x log2e - lse log2e)), streaming 16-byte stores.
// Chunks follow the output row; the host launches it only when each logits row has its output
// row's 16-byte alignment (as v2 with V > 1).  Padding columns (>= C) load nothing; they and
// ignored rows store 0 (a select: the logits may be inf / NaN there); a word straddling C loads
// columns < Cx (in bounds) and zeroes those >= C.
// Each word is loaded before it is stored by the same thread: safe with dx aliasing x.
template <typename T, typename S>
__global__ void __launch_bounds__(kCeMaxThreads)
    crossentropy_backward_v3(const T* x, int64_t ldx, const int64_t* __restrict__ t,
                             const S* __restrict__ lse, const float* __restrict__ scale, T* dx,
                             int C, int Cx, int64_t ii, double ls) {
  constexpr int V = 16 / sizeof(T), U = kCeUnroll;
  const int64_t row = blockIdx.x, tg = t[row];
  const int tid = threadIdx.x, nt = blockDim.x;
  const float ll = static_cast<float>(lse[row]) * kLog2e, sc = scale[row];
  const float offv = static_cast<float>(ls / double(C)), on = static_cast<float>(1 - ls);
  const bool ign = tg == ii, bad = !ign && (tg < 0 || tg >= C);
  const int tgc = ign || bad ? -1 : static_cast<int>(tg);
  const T* p = x + row * ldx;
  T* q = dx + row * Cx;
  auto grad = [&](float v, int c) {
    float d = ex2_approx(fmaf(v, kLog2e, -ll)) - offv;
    d = c == tgc ? d - on : d;
    d = bad ? NAN : d * sc;
    return ign || c >= C ? 0.f : d;  // a select: padding / ignored logits may be inf or NaN
  };
  auto scalar = [&](int c) {
    const float v = c >= C ? 0.f : load_math(p + c);
    q[c] = convert<T>(grad(v, c));
  };
  const int head = ce_head(q, Cx);
  const int nv = (Cx - head) / V, tail0 = head + nv * V;
  if (tid < head) scalar(tid);
  const uint4* pv = reinterpret_cast<const uint4*>(p + head);
  uint4* qv = reinterpret_cast<uint4*>(q + head);
  auto word = [&](const uint4& r, int w) {
    const int c0 = head + w * V;
    float v[V];
    unpack16<T>(r, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = grad(v[k], c0 + k);
    __stcs(qv + w, pack16<T>(v));
  };
  int j = tid;
  // loads depend on the column only (not on t / lse / scale: no wait for those before streaming)
  for (; j + (U - 1) * nt < nv; j += U * nt) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int w = j + u * nt;
      r[u] = head + w * V >= C ? make_uint4(0, 0, 0, 0) : __ldcs(pv + w);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) word(r[u], j + u * nt);
  }
  for (; j < nv; j += nt) word(head + j * V >= C ? make_uint4(0, 0, 0, 0) : __ldcs(pv + j), j);
  if (tail0 + tid < Cx) scalar(tail0 + tid);
}

}  // namespace cuda::nn

#ifndef BT_NN_FUSED_KERNELS_ONLY  // (bench/ln_bwd_check.cu includes the kernels only)
// ================================ launchers =====================================================
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
    if (use_v1()) {
      softmax_backward_v1<T><<<grid, row_threads(C, 1, 256), 0, st>>>(yp, gp, dxp, C, log);
      BT_CUDA_LAUNCH_CHECK(name());
      return;
    }
    dispatch_vec(vec_width<T>({yp, gp, dxp}), [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      softmax_backward_v2<T, V><<<grid, row_threads(C, V), 0, st>>>(yp, gp, dxp, C, log);
      BT_CUDA_LAUNCH_CHECK(name());
    });
  });
}

void LayerNormBackward::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
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
    // v6: rows through a cp.async shared-memory ring, dw / db in registers, on sm_90 one launch
    // (cluster + last-arrival reduce of the partials); elsewhere its partials go to reduce_v4
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
            constexpr int CL = K::kCluster;
            Tensor partial;
            float* pp = nullptr;
            if (acc6) {
              partial = empty_tensor({int64_t(G / CL) * (g6.ds ? 3 : 2) * C}, DType::Float32, dev,
                                     name());
              pp = static_cast<float*>(partial.data_ptr(name()));
            }
            K::launch(G, st, dyp, xp, wp, mp, rp, ep, dxp, pp, g6, R, C, acc6, true, name());
            if (acc6 && CL == 1) {
              launch_ln_bwd_reduce_v6<T>(pp, G, C, g6, st, kV6ReducePdl && di.major >= 9, name());
            }
            ds_done = g6.ds != nullptr;
            return true;
          };
          using K8 = LnBwdV6<T, S, NV, WPR, kV6Warps, kV6Stages, kV6Cluster>;
          using K1 = LnBwdV6<T, S, NV, WPR, kV6Warps, kV6Stages, 1>;
          if (di.major >= 9) return run(ln_tag<K8>{});
          return run(ln_tag<K1>{});
        })) {
      return;
    }
    // v5 (nw8, no prefetch: the prefetch measured slower): a group of warps per row, dw / db
    // in shared memory; the default for fp32 and for 16-bit C <= 1024 with extra
    const bool want5 =
        want == 5 || (want == 6 && ln_bwd_default<T>(C, ep != nullptr, di.major, false) == 5);
    if (want5 && dispatch_v5<T>(C, {dyp, xp, wp, ep, dxp}, [&](auto nvt, auto wt) {
          constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
          using K = LnBwdV5<T, S, NV, WPR, kV5Warps, false, false>;
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
    if (ver == 1) {
      layernorm_backward_dx_v1<T, S><<<static_cast<unsigned>(R), row_threads(C, 1, 256), 0, st>>>(
          dyp, xp, wp, mp, rp, ep, dxp, C);
      BT_CUDA_LAUNCH_CHECK(name());
      if (need_acc) {
        layernorm_backward_dwdb_v1<T, S>
            <<<static_cast<unsigned>(ceil_div(C, 256)), 256, 0, st>>>(dyp, xp, mp, rp, grads, R, C);
        BT_CUDA_LAUNCH_CHECK(name());
      }
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
    if (ver == 1) {
      crossentropy_backward_v1<T, S><<<grid, row_threads(Cx, 1, 256), 0, st>>>(
          xp, ldx, tp, lp, sp, dxp, C, Cx, ignore_index, label_smoothing);
      BT_CUDA_LAUNCH_CHECK(name());
      return;
    }
    dispatch_vec(rows_match ? vec_width<T>({xp, dxp}) : 1, [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      crossentropy_backward_v2<T, S, V><<<grid, row_threads(Cx, V, 512), 0, st>>>(
          xp, ldx, tp, lp, sp, dxp, C, Cx, ignore_index, label_smoothing);
      BT_CUDA_LAUNCH_CHECK(name());
    });
  });
}

#endif  // BT_NN_FUSED_KERNELS_ONLY

}  // namespace bt
