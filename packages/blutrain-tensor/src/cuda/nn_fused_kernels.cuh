// cuda/nn_fused_kernels.cuh: the kernels of cuda/nn_fused.cu (softmax, layer norm and
// cross-entropy backward), the ones its launchers run; the launchers are in nn_fused.cu.  Included
// by nn_fused.cu and by the bench programs that check and time these kernels
// (bench/ln_bwd_check.cu, bench/nn_check.cu); the variants that lost their benchmarks (the v1
// references, layer-norm backward v5 with a prefetch or streaming loads, v6 with clusters) live in
// bench/ (nn_v1_kernels.cuh, ln_bwd_experiments.cuh).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "nn_common.cuh"

namespace bt::cuda::nn {

// ================================ kernels =======================================================

// ---- softmax backward ------------------------------------------------------------------------
// softmax: dx = y * (dy - sum(dy * y)); log_softmax: dx = dy - exp(y) * sum(dy).
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
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ extra), g = dy * w, xhat = (x-mean)*rstd.
// v2: a grid of G blocks, block b takes rows b, b + G, ...; dx vectorised (16-byte loads), and the
// block's dweight / dbias partials accumulate in `acc` (shared memory when 2C fit, else the
// block's slice of `partial`), then go to partial[b * 2C ...] for layernorm_backward_reduce.
// Mixed rows (Note [float32 residual stream], nn_fused.h): x and the weight of X = float under a
// 16-bit dy T, extra / dx of O (T or float); the launcher runs them with V = 1 (scalar), the
// fallback of every mixed shape v6 does not take.
template <typename T, typename S, int V, bool kSmem, typename X = T, typename O = T>
__global__ void layernorm_backward_v2(const T* __restrict__ dy, const X* __restrict__ x,
                                      const X* __restrict__ w, const S* __restrict__ mean,
                                      const S* __restrict__ rstd, const O* __restrict__ extra,
                                      O* __restrict__ dx, math_t<X>* __restrict__ partial,
                                      int64_t R, int64_t C, bool need_acc) {
  using A = math_t<X>;
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
// all hold 3 vectors per lane and array), NW warps per block on a persistent grid.  Rows stay raw
// 16-byte words and are unpacked twice (a few ALU ops next to the memory time).  The weight sits
// in shared
// memory as float; dweight / dbias partials accumulate in a per-group shared slice (each group
// lane owns its columns), rows in order; at the end the block sums its groups' slices in group
// order into partial[block] for layernorm_backward_reduce_v4.  Deterministic for a given grid.
// The next row's loads issued before this row's math (a prefetch) and streaming (evict-first)
// loads / stores measured slower: bench/ln_bwd_experiments.cuh keeps them.
constexpr int kV5Warps = 8;  // warps per block (eval_gpu's choice; the check harness tries 16)

template <typename T, typename S, int NV, int WPR, int NW>
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
        d[j] = __ldg(reinterpret_cast<const uint4*>(dy + off + c));
        xv[j] = __ldg(reinterpret_cast<const uint4*>(x + off + c));
        if (extra) e[j] = __ldg(reinterpret_cast<const uint4*>(extra + off + c));
      }
    }
  };
  uint4 cd[NV], cx[NV], ce[NV];
  float cm = 0.f, cr = 0.f;
  int parity = 0;
  for (; row < R; row += step) {
    load_row(row, cd, cx, ce, cm, cr);
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
        *reinterpret_cast<uint4*>(dx + off + c) = pack16<T>(o);
      }
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
template <typename T, typename S, int NV, int WPR, int NW>
struct LnBwdV5 {
  static constexpr int kThreadsV5 = NW * 32;
  static size_t smem(int64_t C, bool need_acc) {
    return static_cast<size_t>(C + (need_acc ? int64_t(NW / WPR) * 2 * C : 0)) * sizeof(float);
  }
  static int grid(int64_t R, int64_t C, bool need_acc, int sm_count, size_t smem_optin,
                  const char* op) {
    auto kern = layernorm_backward_v5<T, S, NV, WPR, NW>;
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
    layernorm_backward_v5<T, S, NV, WPR, NW><<<G, kThreadsV5, smem(C, need_acc), st>>>(
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
//  - after the row loop each block sums its groups' registers in group order and writes its
//    partial [dw | db (| ds)] for layernorm_backward_reduce_v6, launched as a programmatic
//    dependent.  (One launch on Hopper, blocks of a thread-block cluster summing their partials
//    through distributed shared memory and the last to arrive writing dweight / dbias, measured
//    slower: bench/ln_bwd_experiments.cuh keeps it.)
// Deterministic for a given grid: every sum has a fixed order.
// warps per block and ring slots per row group (K - 1 rows in flight) of the library: one
// 16-warp block per SM, 2 slots measured best for bf16 and fp32, C 768 and 3072, with and
// without extra (ln_bwd_check.sh, session 14: bf16 C 768 79.8% of copy against 75.0% for 8
// warps and 3 slots, 71.0% for 8 and 4; its partials are 132 rows instead of 264)
constexpr int kV6Warps = 16;
constexpr int kV6Stages = 2;
// the partials' reduce as a programmatic dependent launch on sm_90+ (launch_ln_bwd_reduce_v6)
constexpr bool kV6ReducePdl = true;
constexpr int kV6MaxBlocksPerSm = 4;

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

// Mixed rows (Note [float32 residual stream], nn_fused.h): X = float (x and the weight) under a
// 16-bit T (dy), O (extra and dx) T or float.  A lane's V = 8 columns are then one 16-byte word of
// dy and two of x (and of a float O): the ring's rows are C * sizeof of their own type; the float
// weight is read per use (__ldg, L1-resident) instead of kept in registers.  X = O = T is the
// kernel as it was.
template <typename T, typename S, int NV, int WPR, int NW, int K, typename X = T, typename O = T>
__global__ void __launch_bounds__(NW * 32, (NW >= 16 ? 1 : 16 / NW))  // <= 128 registers
    layernorm_backward_v6(const T* __restrict__ dy, const X* __restrict__ x,
                          const X* __restrict__ w, const S* __restrict__ mean,
                          const S* __restrict__ rstd, const O* __restrict__ extra,
                          O* __restrict__ dx, float* __restrict__ partial, LnGrads<T> grads,
                          int64_t R, int64_t C, bool need_acc) {
  constexpr int V = static_cast<int>(16 / sizeof(T)), RG = NW / WPR;
  constexpr bool kSameW = std::is_same_v<X, T>;  // the weight's words kept in registers
  constexpr int XW = static_cast<int>(sizeof(X) / sizeof(T));  // 16-byte words of x a chunk
  constexpr int OW = static_cast<int>(sizeof(O) / sizeof(T));  // of extra / dx
  static_assert(V % 4 == 0 && sizeof(S) == 4, "v6: 16-bit / fp32 rows, float statistics");
  static_assert(K >= 2, "v6 configuration");
  static_assert((XW == 1 || std::is_same_v<X, float>) && (OW == 1 || std::is_same_v<O, float>),
                "v6: x / dx float or T");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // cp.async: sm_80+ (the host launches v6 only there)
#else
  __shared__ float red[2][2 * NW];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, grp = warp / WPR;
  const int gl = (warp % WPR) * 32 + lane;
  // Ring of this group: K slots of [dy | x (| extra)] rows (C * sizeof(T) % 16 == 0, C % V);
  // stats: this warp's (mean, rstd) per slot.  Byte offsets in shared memory.
  const unsigned row_bytes = static_cast<unsigned>(C * sizeof(T));          // dy's; x's and extra's
  const unsigned xrow_bytes = XW * row_bytes, erow_bytes = OW * row_bytes;  // rows follow it
  const unsigned slot_bytes = row_bytes + xrow_bytes + (extra ? erow_bytes : 0u);
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

  uint4 wr[kSameW ? NV : 1];  // the weight's raw words (1 without a weight; T weights only)
  float aw[NV][V], ab[NV][V];
  {
    float one[V];
#pragma unroll
    for (int k = 0; k < V; ++k) one[k] = 1.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if constexpr (kSameW) {
        wr[j] = w && c < C ? __ldg(reinterpret_cast<const uint4*>(w + c)) : pack16<T>(one);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) aw[j][k] = 0.f, ab[j][k] = 0.f;
    }
  }
  // the weight of chunk j (column c) as V floats
  auto weight = [&](int j, int64_t c, float* wv) {
    if constexpr (kSameW) {
      unpack16<T>(wr[j], wv);
    } else if (w) {
      unpack16<float>(__ldg(reinterpret_cast<const uint4*>(w + c)), wv);
      unpack16<float>(__ldg(reinterpret_cast<const uint4*>(w + c + 4)), wv + 4);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) wv[k] = 1.f;
    }
  };
  // V values of a row of type U (1 or 2 words) at shared byte offset a
  auto row_words = [&](auto utag, unsigned a, float* out) {
    using U = typename decltype(utag)::type;
    if constexpr (sizeof(U) == sizeof(T)) {
      unpack16<T>(lds16(a), out);
    } else {
      unpack16<float>(lds16(a), out);
      unpack16<float>(lds16(a + 16), out + 4);
    }
  };

  const int64_t step = int64_t(gridDim.x) * RG;
  const int64_t row0 = int64_t(blockIdx.x) * RG + grp;  // the group's rows: row0 + i * step
  // Copies row r (if any) into slot `slot`, then commits a group (empty past the last row, so
  // every thread's group count stays in step with the loop).
  auto issue = [&](int64_t r, int slot) {
    if (r < R) {
      if constexpr (XW == 1 && OW == 1) {
        ring_copy_row<V, NV, WPR>(ring + slot * slot_bytes, row_bytes, r * C, C, gl, dy, x, extra);
      } else {  // this lane's chunks: dy's word, x's XW words, extra's OW words
        const unsigned sl = ring + slot * slot_bytes;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          const int64_t c = v4_col<V, WPR>(j, gl);
          if (c < C) {
            const int64_t e = r * C + c;
            async_copy16(sl + static_cast<unsigned>(c * sizeof(T)), dy + e);
#pragma unroll
            for (int q = 0; q < XW; ++q) {
              async_copy16(sl + row_bytes + static_cast<unsigned>(c * sizeof(X)) + 16u * q,
                           reinterpret_cast<const char*>(x + e) + 16 * q);
            }
            if (extra) {
#pragma unroll
              for (int q = 0; q < OW; ++q) {
                async_copy16(
                    sl + row_bytes + xrow_bytes + static_cast<unsigned>(c * sizeof(O)) + 16u * q,
                    reinterpret_cast<const char*>(extra + e) + 16 * q);
              }
            }
          }
        }
      }
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
        row_words(type_tag<X>{}, sl + row_bytes + XW * cb, xh);
        weight(j, c, wv);
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
        row_words(type_tag<X>{}, sl + row_bytes + XW * cb, xh);
        weight(j, c, wv);
        if (extra) row_words(type_tag<O>{}, sl + row_bytes + xrow_bytes + OW * cb, ev);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          o[k] = rs * (g[k] * wv[k] - s1 - (xh[k] - m) * rs * s2);
          if (extra) o[k] += ev[k];
        }
        float q[V];  // the stored (rounded) values, as column sums of dx would read them
        if constexpr (OW == 1) {
          const uint4 packed = pack16<T>(o);
          *reinterpret_cast<uint4*>(dx + off + c) = packed;
          if (dsa) unpack16<T>(packed, q);
        } else {
          store8f(reinterpret_cast<float*>(dx + off + c), o);
#pragma unroll
          for (int k = 0; k < V; ++k) q[k] = o[k];
        }
        if (dsa) {
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
  float4* dst = reinterpret_cast<float4*>(partial) + int64_t(blockIdx.x) * n4;
  for (int64_t i = threadIdx.x; i < n4; i += blockDim.x) dst[i] = acc4[i];
#endif
}

// Launch geometry of v6 (shared by eval_gpu and bench/ln_bwd_check.cu).  Shared memory: the rings
// and stats during the row loop, then the groups' [dw | db] slices (2C floats each), summed into
// the block partial (slice 0), and a float4 per thread at the end. Grid: the resident blocks (at
// most kV6MaxBlocksPerSm per SM), no more than the row groups need; 0 where it cannot launch
// (compute capability below 8, or more shared memory than smem_optin).
// X, O: the types of x and of extra / dx (mixed rows, see the kernel).
template <typename T, typename S, int NV, int WPR, int NW, int K, typename X = T, typename O = T>
struct LnBwdV6 {
  static constexpr int kThreads = NW * 32, kRG = NW / WPR;
  static auto kernel() { return layernorm_backward_v6<T, S, NV, WPR, NW, K, X, O>; }
  static size_t smem(int64_t C, bool extra, bool ds = false) {
    const size_t row = sizeof(T) + sizeof(X) + (extra ? sizeof(O) : 0);  // bytes a column
    const size_t ring = size_t(kRG) * K * row * size_t(C);
    const size_t stats = size_t(NW) * K * 2 * sizeof(float);
    const size_t nseg = ds ? 3 : 2;
    // the groups' [dw | db (| ds)] slices, then the block partial (slice 0) and a float4 per
    // thread; with ds, the groups' dx column sums past both the ring and the slices (the kernel
    // computes the same offset)
    const size_t slices = size_t(kRG) * nseg * C * sizeof(float);
    const size_t tail = nseg * C * sizeof(float) + size_t(kThreads) * 16;
    if (ds) {
      const size_t dsa = size_t(kRG) * C * sizeof(float);
      return std::max(std::max(ring + stats, slices) + dsa, tail);
    }
    return std::max({ring + stats, slices, tail});
  }
  static int grid(int64_t R, int64_t C, bool extra, int sm_count, size_t smem_optin, int major,
                  const char* op, bool ds = false) {
    auto kern = kernel();
    const size_t sm = smem(C, extra, ds);
    if (major < 8 || sm > smem_optin) return 0;
    BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(sm)));
    int per_sm = 0;
    BT_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kThreads, sm));
    per_sm = std::min(per_sm, kV6MaxBlocksPerSm);
    const int64_t cap = int64_t(sm_count) * per_sm;
    const int64_t need = ceil_div(R, int64_t(kRG));
    return static_cast<int>(std::min<int64_t>(need, cap));
  }
  // G partials are left for layernorm_backward_reduce_v6 (or _v4).
  static void launch(int G, cudaStream_t st, const T* dy, const X* x, const X* w, const S* mean,
                     const S* rstd, const O* extra, O* dx, float* partial, LnGrads<T> grads,
                     int64_t R, int64_t C, bool need_acc, const char* op) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(G));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem(C, extra != nullptr, grads.ds != nullptr);
    cfg.stream = st;
    BT_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, kernel(), dy, x, w, mean, rstd, extra, dx, partial,
                                         grads, R, C, need_acc));
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
  const float lf = static_cast<float>(lse[row]), ll = lf * kLog2e, sc = scale[row];
  const float el = log2e_residual(lf, ll);  // Note [lse to m's last bit]
  const float offv = static_cast<float>(ls / double(C)), on = static_cast<float>(1 - ls);
  const bool ign = tg == ii, bad = !ign && (tg < 0 || tg >= C);
  const bool huge = ce_huge(lf);  // Note [huge logits]: natural units for this row
  const int tgc = ign || bad ? -1 : static_cast<int>(tg);
  const T* p = x + row * ldx;
  T* q = dx + row * Cx;
  auto grad = [&](float v, int c, auto hg) {
    float d = (decltype(hg)::value ? expf(v - lf) : ex2_approx(fmaf(v, kLog2e, -ll) - el)) - offv;
    d = c == tgc ? d - on : d;
    d = bad ? NAN : d * sc;
    return ign || c >= C ? 0.f : d;  // a select: padding / ignored logits may be inf or NaN
  };
  auto scalar = [&](int c) {
    const float v = c >= C ? 0.f : load_math(p + c);
    q[c] = convert<T>(huge ? grad(v, c, ic<1>{}) : grad(v, c, ic<0>{}));
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
    if (huge) {  // once per word, after its load: the loads never wait for lse
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = grad(v[k], c0 + k, ic<1>{});
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = grad(v[k], c0 + k, ic<0>{});
    }
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

}  // namespace bt::cuda::nn
