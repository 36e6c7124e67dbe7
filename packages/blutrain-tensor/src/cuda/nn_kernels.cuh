// cuda/nn_kernels.cuh: the kernels of cuda/nn.cu (softmax / log_softmax, layer norm with the
// fused residual add, cross-entropy forward), the ones its launchers run; the launchers are in
// nn.cu.  Included by nn.cu and by the bench programs that check and time these kernels
// (bench/ln_fwd_check.cu, bench/nn_check.cu); the variants that lost their benchmarks (the v1
// references) live in bench/ (bench/nn_v1_kernels.cuh).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "device_errors.h"
#include "nn_common.cuh"

namespace bt::cuda::nn {

// ================================ kernels =======================================================

// ---- softmax ----------------------------------------------------------------------------------
template <typename T, int V>
__global__ void softmax_forward_v2(const T* __restrict__ x, T* __restrict__ y, int64_t C, bool lg) {
  using A = math_t<T>;
  __shared__ A scratch[64];
  const T* p = x + blockIdx.x * C;
  T* q = y + blockIdx.x * C;
  A m = -INFINITY, s = 0;
  row_chunks<V>(p, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N];
    load_n<N>(p + i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) ms_add(m, s, v[k]);
  });
  block_ms(m, s, scratch);
  ms_finish(m, s);  // Note [online softmax special values]
  // log_softmax as (v - m) - log(s): m + log(s) first would round log(s) away for a large m
  const A ls = log(s), inv = A(1) / s;
  row_chunks<V>(p, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N];
    load_n<N>(p + i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = lg ? (v[k] - m) - ls : exp(v[k] - m) * inv;
    store_n<N>(q + i, v);
  });
}

// v3: one warp per row (kV3Warps rows per block), the row in registers (nn_common.cuh): one read
// of x, one write of y, warp-shuffle reductions only.  Same formulas as v2.
template <typename T, int V, int NV>
__global__ void softmax_forward_v3(const T* __restrict__ x, T* __restrict__ y, int64_t R, int64_t C,
                                   bool lg) {
  using A = math_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kV3Warps + threadIdx.x / 32;
  if (row >= R) return;  // whole warps only: no block barriers below
  const T* p = x + row * C;
  A v[NV][V];
  A m = -INFINITY;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
    if (c < C) {
      load_n<V>(p + c, v[j]);
#pragma unroll
      for (int k = 0; k < V; ++k) m = max(m, v[j][k]);
    }
  }
  m = warp_max(m);
  if (m == -INFINITY) m = 0;  // an all -inf row: as the CPU
  A s = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (v3_col<V>(j, lane) < C) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A e = exp(v[j][k] - m);
        s += e;
        if (!lg) v[j][k] = e;
      }
    }
  }
  s = warp_sum(s);
  const A ls = log(s), inv = A(1) / s;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
    if (c < C) {
#pragma unroll
      for (int k = 0; k < V; ++k) v[j][k] = lg ? (v[j][k] - m) - ls : v[j][k] * inv;
      store_n<V>(y + row * C + c, v[j]);
    }
  }
}

// ---- layer norm (optionally on x + residual) --------------------------------------------------
// v2: vector loads; with kAdd, pass 1 reads x and residual once, writes sum = x + residual
// (rounded to T) and the later passes re-read this thread's own sum chunks (cache hits).
template <typename T, typename S, int V, bool kAdd>
__global__ void layernorm_forward_v2(const T* __restrict__ x, const T* __restrict__ res,
                                     const T* __restrict__ w, const T* __restrict__ b,
                                     T* __restrict__ sum_o, T* __restrict__ y,
                                     S* __restrict__ mean_o, S* __restrict__ rstd_o, int64_t C,
                                     double eps) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const int64_t row = blockIdx.x;
  const T* p = x + row * C;
  const T* src = kAdd ? sum_o + row * C : p;  // what passes 2 and 3 read
  T* q = y + row * C;
  A s = 0;
  row_chunks<V>(p, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N];
    load_n<N>(p + i, v);
    if constexpr (kAdd) {
      A r[N];
      load_n<N>(res + row * C + i, r);
#pragma unroll
      for (int k = 0; k < N; ++k) v[k] = convert<A>(convert<T>(v[k] + r[k]));
      store_n<N>(sum_o + row * C + i, v);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) s += v[k];
  });
  const A mean = block_sum(s, scratch) / A(C);
  A ss = 0;
  row_chunks<V>(p, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N];
    load_n<N>(src + i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) ss += (v[k] - mean) * (v[k] - mean);
  });
  const A rstd = A(1) / sqrt(block_sum(ss, scratch) / A(C) + A(eps));
  if (threadIdx.x == 0) mean_o[row] = mean, rstd_o[row] = rstd;
  row_chunks<V>(p, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N], wv[N], bv[N];
    load_n<N>(src + i, v);
    if (w) load_n<N>(w + i, wv);
    if (b) load_n<N>(b + i, bv);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = (v[k] - mean) * rstd;
      if (w) v[k] *= wv[k];
      if (b) v[k] += bv[k];
    }
    store_n<N>(q + i, v);
  });
}

// v3: one warp per row (kV3Warps rows per block), the row (and with kAdd the rounded sum) in
// registers: x (and residual) read once, y (and sum) written once; exact two-pass statistics from
// registers; warp-shuffle reductions (deterministic).  rb (kAdd only, may be null): a residual
// bias added to the sum before its one rounding, (x + res) + rb as the CPU's (Note [residual
// bias]).
template <typename T, typename S, int V, int NV, bool kAdd>
__global__ void layernorm_forward_v3(const T* __restrict__ x, const T* __restrict__ res,
                                     const T* __restrict__ w, const T* __restrict__ b,
                                     T* __restrict__ sum_o, T* __restrict__ y,
                                     S* __restrict__ mean_o, S* __restrict__ rstd_o, int64_t R,
                                     int64_t C, double eps, const T* __restrict__ rb = nullptr) {
  using A = math_t<T>;
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kV3Warps + threadIdx.x / 32;
  if (row >= R) return;  // whole warps only: no block barriers below
  const int64_t off = row * C;
  A v[NV][V];
  A s = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
    if (c < C) {
      load_n<V>(x + off + c, v[j]);
      if constexpr (kAdd) {
        A r[V];
        load_n<V>(res + off + c, r);
        if (rb) {
          A bv[V];
          load_n<V>(rb + c, bv);
#pragma unroll
          for (int k = 0; k < V; ++k) v[j][k] = convert<A>(convert<T>(v[j][k] + r[k] + bv[k]));
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) v[j][k] = convert<A>(convert<T>(v[j][k] + r[k]));
        }
        store_n<V>(sum_o + off + c, v[j]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) s += v[j][k];
    }
  }
  const A mean = warp_sum(s) / A(C);
  A ss = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (v3_col<V>(j, lane) < C) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[j][k] -= mean;  // centred once, for the squares and the normalisation
        ss += v[j][k] * v[j][k];
      }
    }
  }
  const A rstd = A(1) / sqrt(warp_sum(ss) / A(C) + A(eps));
  if (lane == 0) mean_o[row] = mean, rstd_o[row] = rstd;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
    if (c < C) {
      A wv[V], bv[V];
      if (w) load_n<V>(w + c, wv);
      if (b) load_n<V>(b + c, bv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[j][k] *= rstd;  // (v centred above)
        if (w) v[j][k] *= wv[k];
        if (b) v[j][k] += bv[k];
      }
      store_n<V>(y + off + c, v[j]);
    }
  }
}

// ---- mixed rows (Note [float32 residual stream], nn_fused.h) ----------------------------------
// float32 x (and sum), 16-bit T residual and y, float32 weight / bias / residual bias: the sum
// x + res (+ rb) in float32 (the CPU's order), the statistics of the float32 row, y rounded once.
// v3's layout (one warp per row, the row in registers) with chunks of V = 8 columns: one 16-byte
// word of T, two of float.  Without kAdd it is layer_norm(x float32) -> y T (the same statistics
// in the same order, so a recomputed y is bitwise add_layer_norm's).  Bytes per element: 12 with
// the add (x 4, res 2, sum 4, y 2), 6 without.
template <typename T, int NV, bool kAdd>
__global__ void layernorm_forward_mixed_v3(const float* __restrict__ x, const T* __restrict__ res,
                                           const float* __restrict__ w, const float* __restrict__ b,
                                           const float* __restrict__ rb, float* __restrict__ sum_o,
                                           T* __restrict__ y, float* __restrict__ mean_o,
                                           float* __restrict__ rstd_o, int64_t R, int64_t C,
                                           double eps) {
  constexpr int V = 8;
  static_assert(sizeof(T) == 2, "mixed rows: 16-bit T");
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kV3Warps + threadIdx.x / 32;
  if (row >= R) return;  // whole warps only: no block barriers below
  const int64_t off = row * C;
  float v[NV][V];
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
    if (c < C) {
      load8f(x + off + c, v[j]);
      if constexpr (kAdd) {
        float r[V];
        unpack16<T>(*reinterpret_cast<const uint4*>(res + off + c), r);
#pragma unroll
        for (int k = 0; k < V; ++k) v[j][k] += r[k];
        if (rb) {
          float bv[V];
          load8f(rb + c, bv);
#pragma unroll
          for (int k = 0; k < V; ++k) v[j][k] += bv[k];
        }
        store8f(sum_o + off + c, v[j]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) s += v[j][k];
    }
  }
  const float mean = warp_sum(s) / float(C);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (v3_col<V>(j, lane) < C) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[j][k] -= mean;
        ss += v[j][k] * v[j][k];
      }
    }
  }
  const float rstd = 1.f / sqrtf(warp_sum(ss) / float(C) + float(eps));
  if (lane == 0) mean_o[row] = mean, rstd_o[row] = rstd;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v3_col<V>(j, lane);
    if (c < C) {
      float wv[V], bv[V];
      if (w) load8f(w + c, wv);
      if (b) load8f(b + c, bv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[j][k] *= rstd;
        if (w) v[j][k] *= wv[k];
        if (b) v[j][k] += bv[k];
      }
      *reinterpret_cast<uint4*>(y + off + c) = pack16<T>(v[j]);
    }
  }
}

// Mixed rows v3 does not take (C % 8 != 0, misaligned, rows over 3072; or BT_CUDA_NN_VERSION=2):
// one block per row, scalar, three passes (the later ones re-read the thread's own sums).
template <typename T, bool kAdd>
__global__ void layernorm_forward_mixed_v2(const float* __restrict__ x, const T* __restrict__ res,
                                           const float* __restrict__ w, const float* __restrict__ b,
                                           const float* __restrict__ rb, float* __restrict__ sum_o,
                                           T* __restrict__ y, float* __restrict__ mean_o,
                                           float* __restrict__ rstd_o, int64_t C, double eps) {
  __shared__ float scratch[32];
  const int64_t off = int64_t(blockIdx.x) * C;
  const float* src = kAdd ? sum_o + off : x + off;  // what passes 2 and 3 read
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    float v = x[off + i];
    if constexpr (kAdd) {
      v += convert<float>(res[off + i]);
      if (rb) v += rb[i];
      sum_o[off + i] = v;
    }
    s += v;
  }
  const float mean = block_sum(s, scratch) / float(C);
  float ss = 0.f;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float d = src[i] - mean;
    ss += d * d;
  }
  const float rstd = 1.f / sqrtf(block_sum(ss, scratch) / float(C) + float(eps));
  if (threadIdx.x == 0) mean_o[blockIdx.x] = mean, rstd_o[blockIdx.x] = rstd;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    float v = (src[i] - mean) * rstd;
    if (w) v *= w[i];
    if (b) v += b[i];
    y[off + i] = convert<T>(v);
  }
}

// v4: a group of WPR warps per row, kV4Warps / WPR rows per block (nn_common.cuh), at most
// kV4MaxPerLane elements per lane: 3072-wide rows stay in registers without starving the SM of
// warps.  x (and residual) read once, y (and sum) written once; exact two-pass statistics.
template <typename T, typename S, int V, int NV, int WPR, bool kAdd>
__global__ void __launch_bounds__(kV4Warps * 32)
    layernorm_forward_v4(const T* __restrict__ x, const T* __restrict__ res,
                         const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ sum_o,
                         T* __restrict__ y, S* __restrict__ mean_o, S* __restrict__ rstd_o,
                         int64_t R, int64_t C, double eps) {
  using A = float;  // v4 runs for 16-bit and fp32 inputs only
  __shared__ float red[2][2 * kV4Warps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int gl = (warp % WPR) * 32 + lane;
  const int64_t row = int64_t(blockIdx.x) * (kV4Warps / WPR) + warp / WPR;
  // rows past R still take part in the group barriers of group_sum2
  const bool valid = row < R;
  const int64_t off = valid ? row * C : 0;
  A v[NV][V];
  A s = 0;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v4_col<V, WPR>(j, gl);
    if (valid && c < C) {
      load_n<V>(x + off + c, v[j]);
      if constexpr (kAdd) {
        A r[V];
        load_n<V>(res + off + c, r);
#pragma unroll
        for (int k = 0; k < V; ++k) v[j][k] = convert<A>(convert<T>(v[j][k] + r[k]));
        store_n<V>(sum_o + off + c, v[j]);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) s += v[j][k];
    }
  }
  const float2 stats = group_mean_rstd<V, NV, WPR, kV4Warps>(v, s, valid, gl, C, eps, red);
  const A mean = stats.x, rstd = stats.y;
  if (!valid) return;  // no barriers below
  if (gl == 0) mean_o[row] = mean, rstd_o[row] = rstd;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v4_col<V, WPR>(j, gl);
    if (c < C) {
      A wv[V], bv[V];
      if (w) load_n<V>(w + c, wv);
      if (b) load_n<V>(b + c, bv);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[j][k] *= rstd;  // (v centred by group_mean_rstd)
        if (w) v[j][k] *= wv[k];
        if (b) v[j][k] += bv[k];
      }
      store_n<V>(y + off + c, v[j]);
    }
  }
}

// v6 (bf16 C = 3072 stayed at 65-71% of copy with v4: a block's rows are loaded, reduced and
// stored in turn, so with ~2 waves of blocks the loads and the stores barely overlapped):
// persistent blocks of NW warps, a group of WPR warps per row (dispatch_v5's layout), each group's
// rows (x, and with kAdd the residual) arriving through a ring of K shared-memory slots filled by
// cp.async, so K - 1 rows are in flight while the group normalises one.  Each lane copies and
// reads only its own columns, so a slot needs no barrier (cp.async.wait_group orders it per
// thread).  Same sums in the same order as v4 for the same layout; weight / bias as raw 16-byte
// words in registers.  v6 holds the row in registers (~116 of them: 16 warps an SM).  Tried
// (session 18): re-reading the row from its slot in each pass instead (32-64 registers, up to 3x
// the warps and rows in flight) was slower in every case (bf16 4096 x 3072: 62-70% of copy against
// 76%), so rows in flight are not what v6 lacks there.
template <typename T, typename S, int NV, int WPR, int NW, int K, bool kAdd>
__global__ void __launch_bounds__(NW * 32)
    layernorm_forward_v6(const T* __restrict__ x, const T* __restrict__ res,
                         const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ sum_o,
                         T* __restrict__ y, S* __restrict__ mean_o, S* __restrict__ rstd_o,
                         int64_t R, int64_t C, double eps) {
  constexpr int V = static_cast<int>(16 / sizeof(T)), RG = NW / WPR;
  static_assert(V % 4 == 0 && sizeof(S) == 4 && K >= 2, "v6: 16-bit / fp32 rows, float stats");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // cp.async: sm_80+ (the host launches v6 only there)
#else
  __shared__ float red[2][2 * NW];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, grp = warp / WPR;
  const int gl = (warp % WPR) * 32 + lane;
  const unsigned row_bytes = static_cast<unsigned>(C * sizeof(T));
  const unsigned slot_bytes = (kAdd ? 2u : 1u) * row_bytes;
  const unsigned ring = smem_addr(smem_raw) + unsigned(grp) * K * slot_bytes;
  uint4 wr[NV], br[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v4_col<V, WPR>(j, gl);
    const bool in = c < C;
    wr[j] = w && in ? __ldg(reinterpret_cast<const uint4*>(w + c)) : uint4{};
    br[j] = b && in ? __ldg(reinterpret_cast<const uint4*>(b + c)) : uint4{};
  }
  const int64_t step = int64_t(gridDim.x) * RG;
  const int64_t row0 = int64_t(blockIdx.x) * RG + grp;  // the group's rows: row0 + i * step
  // Copies row r (if any) into slot `slot`, then commits a group (empty past the last row, so
  // every thread's group count stays in step with the loop).
  auto issue = [&](int64_t r, int slot) {
    if (r < R) {
      ring_copy_row<V, NV, WPR>(ring + slot * slot_bytes, row_bytes, r * C, C, gl, x,
                                kAdd ? res : nullptr);
    }
    async_commit();
  };
#pragma unroll
  for (int k = 0; k < K - 1; ++k) issue(row0 + k * step, k);

  int slot = 0;
  // Every group runs the block's trip count (idle past R), so group_sum2's barriers pair up.
  for (int64_t base = row0 - grp; base < R; base += step) {
    const int64_t row = base + grp, off = row * C;
    const bool live = row < R;
    issue(row + (K - 1) * step, slot == 0 ? K - 1 : slot - 1);  // the slot read last turn
    async_wait<K - 1>();  // this row's copies (this thread's) landed
    const unsigned sl = ring + slot * slot_bytes;
    float v[NV][V];
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (live && c < C) {
        const unsigned cb = static_cast<unsigned>(c * sizeof(T));
        unpack16<T>(lds16(sl + cb), v[j]);
        if constexpr (kAdd) {
          float r[V];
          unpack16<T>(lds16(sl + row_bytes + cb), r);
#pragma unroll
          for (int k = 0; k < V; ++k) v[j][k] = convert<float>(convert<T>(v[j][k] + r[k]));
          *reinterpret_cast<uint4*>(sum_o + off + c) = pack16<T>(v[j]);
        }
#pragma unroll
        for (int k = 0; k < V; ++k) s += v[j][k];
      }
    }
    const float2 stats = group_mean_rstd<V, NV, WPR, NW>(v, s, live, gl, C, eps, red);
    const float mean = stats.x, rstd = stats.y;
    if (live && gl == 0) mean_o[row] = mean, rstd_o[row] = rstd;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int64_t c = v4_col<V, WPR>(j, gl);
      if (live && c < C) {
        float wv[V], bv[V];
        if (w) unpack16<T>(wr[j], wv);
        if (b) unpack16<T>(br[j], bv);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          v[j][k] *= rstd;  // (v centred by group_mean_rstd)
          if (w) v[j][k] *= wv[k];
          if (b) v[j][k] += bv[k];
        }
        *reinterpret_cast<uint4*>(y + off + c) = pack16<T>(v[j]);
      }
    }
    slot = slot + 1 == K ? 0 : slot + 1;
  }
  async_wait<0>();  // the (empty) groups still pending
#endif
}

// Launch geometry of forward v6 (shared by layernorm_forward and bench/ln_fwd_check.cu): the
// rings in dynamic shared memory; a persistent grid of the resident blocks (at most
// kLnFwdV6MaxBlocksPerSm per SM), no more than the row groups need; 0 where it cannot launch
// (compute capability below 8, or more shared memory than smem_optin).
constexpr int kLnFwdV6MaxBlocksPerSm = 8;
template <typename T, typename S, int NV, int WPR, int NW, int K, bool kAdd>
struct LnFwdV6 {
  static constexpr int kThreads = NW * 32, kRG = NW / WPR;
  static auto kernel() { return layernorm_forward_v6<T, S, NV, WPR, NW, K, kAdd>; }
  static size_t smem(int64_t C) { return size_t(kRG) * K * (kAdd ? 2 : 1) * size_t(C) * sizeof(T); }
  // Resident blocks per SM for rows of C (the occupancy query; cached by the caller).  The
  // kernel's dynamic shared memory limit is raised to all the opt-in its static shared memory
  // leaves, not to this C's need: a cached answer for a longer C must still launch after a
  // shorter C's query.
  static int per_sm(int64_t C, size_t smem_optin, int major, const char* op) {
    if (major < 8) return 0;
    auto kern = kernel();
    cudaFuncAttributes fa{};
    BT_CUDA_CHECK(op, cudaFuncGetAttributes(&fa, kern));
    const size_t sm = smem(C), cap = smem_optin - std::min(smem_optin, fa.sharedSizeBytes);
    if (sm > cap) return 0;
    BT_CUDA_CHECK(op, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(cap)));
    int n = 0;
    BT_CUDA_CHECK(op, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kern, kThreads, sm));
    return std::min(n, kLnFwdV6MaxBlocksPerSm);
  }
  static int grid(int64_t R, int per_sm, int sm_count) {
    return static_cast<int>(
        std::min<int64_t>(ceil_div(R, int64_t(kRG)), int64_t(sm_count) * per_sm));
  }
  static void launch(int G, cudaStream_t st, const T* x, const T* res, const T* w, const T* b,
                     T* sum_o, T* y, S* mean, S* rstd, int64_t R, int64_t C, double eps) {
    kernel()<<<G, kThreads, smem(C), st>>>(x, res, w, b, sum_o, y, mean, rstd, R, C, eps);
  }
};

// Forward v6 as the library runs it: kLnFwdV6Warps warps per block, kLnFwdV6Stages ring slots
// per row group; by default for 16-bit rows over kV4MinDefaultC.  Measured (ln_fwd_check.sh,
// session 15, H200, % of a D2D copy): bf16 4096 x 3072 75.5% (v4 64.7%), with the residual add
// 91.0% (v4 86.7%); at C = 768 and in fp32 v3 / v4 stay (within 2% of v6's best there).
// Session 18, the row centred once (group_mean_rstd): 80.6-81.6% and 92.3-92.4%.
constexpr int kLnFwdV6Warps = 16, kLnFwdV6Stages = 3;
template <typename T>
inline bool ln_fwd_v6_default(int64_t C) {
  return sizeof(T) == 2 && C > kV4MinDefaultC;
}

// ---- cross-entropy ----------------------------------------------------------------------------
// Logits rows start `ld` elements apart (>= C: a narrow or padded view is read in place) and the
// first C columns are the classes.  Per row: lse (S), and the row loss either straight to
// `loss_o` (reduction none, in O) or as float/double into `row_loss` for the reduction pass.
// Ignored rows give 0.  An out-of-range target gives NaN and is recorded in index.cu's error
// record (`err`), so the host raises IndexError at its next synchronisation.
// xt: the target's logit (read by the caller when 0 <= tgt < C); lse = m + logs, and the loss
// takes (m - xt) + logs (Note [lse to m's last bit]).
template <typename T, typename S, typename O>
__device__ __forceinline__ void ce_finish_lse(int64_t row, math_t<T> m, math_t<T> logs,
                                              math_t<T> sum_x, math_t<T> xt, int64_t tgt, int64_t C,
                                              int64_t ii, double ls, S* lse_o, O* loss_o,
                                              math_t<T>* row_loss, DeviceErrorSink err) {
  using A = math_t<T>;
  lse_o[row] = m + logs;
  A loss = 0;
  if (tgt != ii) {
    if (tgt < 0 || tgt >= C) {
      loss = NAN;
      record_device_error(err, tgt, C);
    } else {
      const A nll = (m - xt) + logs;
      // ls == 0: nll alone (as PyTorch), so masked (-inf) logits give a finite loss, not 0 * inf
      loss = ls == 0 ? nll : A(1 - ls) * nll + A(ls) * ((m - sum_x / A(C)) + logs);
    }
  }
  if (loss_o) loss_o[row] = convert<O>(loss);
  if (row_loss) row_loss[row] = loss;
}
template <typename T, typename S, typename O>
__device__ __forceinline__ void ce_finish_row(int64_t row, math_t<T> m, math_t<T> s,
                                              math_t<T> sum_x, const T* p, int64_t tgt, int64_t C,
                                              int64_t ii, double ls, S* lse_o, O* loss_o,
                                              math_t<T>* row_loss, DeviceErrorSink err) {
  const math_t<T> xt = tgt >= 0 && tgt < C ? load_math(p + tgt) : math_t<T>(0);
  ce_finish_lse<T, S, O>(row, m, log(s), sum_x, xt, tgt, C, ii, ls, lse_o, loss_o, row_loss, err);
}

// v2: one pass, 16-byte loads.  row_chunks aligns each row on its own (head / tail elements), so
// any row stride keeps the vector loads.
template <typename T, typename S, typename O, int V>
__global__ void crossentropy_forward_v2(const T* __restrict__ x, int64_t ld,
                                        const int64_t* __restrict__ t, S* __restrict__ lse_o,
                                        O* __restrict__ loss_o, math_t<T>* __restrict__ row_loss,
                                        int64_t C, int64_t ii, double ls, DeviceErrorSink err) {
  using A = math_t<T>;
  __shared__ A scratch[64];
  const int64_t row = blockIdx.x;
  const T* p = x + row * ld;
  A m = -INFINITY, s = 0, sx = 0;
  row_chunks<V>(p, C, [&](int64_t i, auto n) {
    constexpr int N = decltype(n)::value;
    A v[N];
    load_n<N>(p + i, v);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      ms_add(m, s, v[k]);
      sx += v[k];
    }
  });
  block_ms(m, s, scratch);
  sx = block_sum(sx, scratch);
  ms_finish(m, s);  // Note [online softmax special values]
  if (threadIdx.x == 0)
    ce_finish_row<T, S, O>(row, m, s, sx, p, t[row], C, ii, ls, lse_o, loss_o, row_loss, err);
}

// One group of N values of a row into its running max m (ml = m log2e, rounded) and sum
// s = sum 2^(x log2e - ml): per group one max and branch (rescale only on a new running max),
// then per value one FFMA + MUFU ex2.
template <int N>
__device__ __forceinline__ void ce_online_add(const float* v, float& m, float& ml, float& s) {
  float cm = v[0];
#pragma unroll
  for (int k = 1; k < N; ++k) cm = fmaxf(cm, v[k]);
  if (cm > m) {  // new running max: rescale (ex2(-inf) = 0 covers the first finite value)
    const float nml = cm * kLog2e;
    s *= ex2_approx(ml - nml);
    m = cm;
    ml = nml;
  }
  const float off = ml == -INFINITY ? 0.f : ml;  // all -inf so far: terms are 0, not NaN
  float e = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) e += ex2_approx(fmaf(v[k], kLog2e, -off));
  s += e;
}

// v3: memory speed (the v2 loop was issue-bound: a full-precision expf and a branch per element).
// kCeThreads per row, kCeUnroll 16-byte streaming loads in flight per thread; per word one max and
// branch (rescale only on a new running max), then per element one FFMA + MUFU ex2 in log2 units:
// s = sum 2^(x log2e - ml), ml = fl(m log2e), so lse = (ML + log2 s) ln2 is exact in ML's rounding.
// Fixed-order block reductions (deterministic).  NaN logits give a NaN lse; +inf ones NaN (as the
// CPU); an all -inf row lse = -inf (as v2); a row of huge logits takes a second pass in natural
// units (Note [huge logits]).  Rows start ld elements apart, any alignment (scalar head / tail
// around the 16-byte words).
template <typename T, typename S, typename O, bool kSx>
__global__ void __launch_bounds__(kCeMaxThreads)
    crossentropy_forward_v3(const T* __restrict__ x, int64_t ld, const int64_t* __restrict__ t,
                            S* __restrict__ lse_o, O* __restrict__ loss_o,
                            float* __restrict__ row_loss, int C, int64_t ii, double ls,
                            DeviceErrorSink err) {
  constexpr int V = 16 / sizeof(T), U = kCeUnroll;
  __shared__ float scratch[64];
  const int64_t row = blockIdx.x;
  const T* p = x + row * ld;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int64_t tg = t[row];  // needed at the end: its latency hides behind the row's loads
  float m = -INFINITY, ml = -INFINITY, s = 0, sx = 0;
  auto add = [&](const float* v, auto n) {
    constexpr int N = decltype(n)::value;
    ce_online_add<N>(v, m, ml, s);
    if constexpr (kSx) {
#pragma unroll
      for (int k = 0; k < N; ++k) sx += v[k];
    }
  };
  const int head = ce_head(p, C);
  const int nv = (C - head) / V, tail0 = head + nv * V;
  const uint4* pv = reinterpret_cast<const uint4*>(p + head);
  auto walk = [&](auto&& f) {  // this thread's values of the row, in groups
    if (tid < head) {
      const float v = load_math(p + tid);
      f(&v, ic<1>{});
    }
    int j = tid;
    for (; j + (U - 1) * nt < nv; j += U * nt) {
      uint4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) r[u] = __ldcs(pv + j + u * nt);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float v[V];
        unpack16<T>(r[u], v);
        f(v, ic<V>{});
      }
    }
    for (; j < nv; j += nt) {
      float v[V];
      unpack16<T>(__ldcs(pv + j), v);
      f(v, ic<V>{});
    }
    if (tail0 + tid < C) {
      const float v = load_math(p + tail0 + tid);
      f(&v, ic<1>{});
    }
  };
  walk(add);
  // the target's logit, in flight during the reductions
  const float xt = tid == 0 && tg >= 0 && tg < C ? load_math(p + tg) : 0.f;
  const float M = block_max(m, scratch, -INFINITY);
  const float ML = M * kLog2e, eM = log2e_residual(M, ML);
  const bool huge = ce_huge(M);                         // the same for the whole block
  float st = s == 0.f ? 0.f : s * ex2_approx(ml - ML);  // s == 0: ml may be -inf like ML
  if (huge) {  // Note [huge logits]: a second pass, natural units
    st = 0;
    walk([&](const float* v, auto n) {
#pragma unroll
      for (int k = 0; k < decltype(n)::value; ++k) st += expf(v[k] - M);
    });
  } else if (!isfinite(st) && isfinite(M)) {  // Note [lse to m's last bit]: this thread, again
    st = 0;
    walk([&](const float* v, auto n) {
#pragma unroll
      for (int k = 0; k < decltype(n)::value; ++k) st += ex2_approx(fmaf(v[k], kLog2e, -ML));
    });
  }
  st = warp_sum(st);
  if constexpr (kSx) sx = warp_sum(sx);
  const int lane = tid % 32, warp = tid / 32;
  if (lane == 0) scratch[warp] = st, scratch[32 + warp] = sx;
  __syncthreads();
  if (tid == 0) {
    float ss = 0, sxx = 0;
    for (int w = 0; w < nt / 32; ++w) ss += scratch[w], sxx += scratch[32 + w];  // fixed order
    const float logs = huge ? logf(ss) : (log2f(ss) - eM) * kLn2;
    ce_finish_lse<T, S, O>(row, M, logs, sxx, xt, tg, C, ii, ls, lse_o, loss_o, row_loss, err);
  }
}

// v4, the chunked classifier's (Note [chunked classifier], autocast.h): the forward and the
// summed loss's backward of one row in one kernel that reads the row from memory once.  Pass 1
// streams the row as v3 does (running max; sum of 2^(x log2e - ml), FFMA + MUFU ex2) and keeps
// each 16-byte word in shared memory; pass 2 writes exp(x - lse) - onehot from there over the
// logits (v3's backward arithmetic, times *scale where given: the mean's 1 / count; exactly the
// same bits as before for no scale, d * 1 = d).  v3's forward + backward read the row twice
// and write it once; this reads it once.  Rows are Cx elements apart, 16-byte aligned; columns
// >= C are padding (not loaded, gradient 0).  Row losses to row_loss, 0 for ignored rows; an
// out-of-range target gives a NaN loss and gradient row and is recorded in `err`.
template <typename T>
__global__ void __launch_bounds__(kCeMaxThreads)
    crossentropy_fwd_bwd_v4(T* x, const int64_t* __restrict__ t, float* __restrict__ lse_o,
                            float* __restrict__ row_loss, const float* __restrict__ scale, int C,
                            int Cx, int64_t ii, DeviceErrorSink err) {
  extern __shared__ uint4 srow[];  // the row's first ceil(C / V) words
  constexpr int V = 16 / sizeof(T), U = kCeUnroll;
  __shared__ float scratch[64];
  __shared__ float lse_s;
  const int64_t row = blockIdx.x, tg = t[row];
  uint4* pv = reinterpret_cast<uint4*>(x + row * int64_t(Cx));
  const int tid = threadIdx.x, nt = blockDim.x;
  const int nv = Cx / V, nfull = C / V, nload = (C + V - 1) / V;
  float m = -INFINITY, ml = -INFINITY, s = 0;
  auto add = [&](const uint4& r, int w) {
    float v[V];
    unpack16<T>(r, v);
    if (w >= nfull) {  // the word straddling C: its padding columns count for nothing
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = w * V + k < C ? v[k] : -INFINITY;
    }
    ce_online_add<V>(v, m, ml, s);
  };
  int j = tid;
  for (; j + (U - 1) * nt < nload; j += U * nt) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldcs(pv + j + u * nt);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      srow[j + u * nt] = r[u];
      add(r[u], j + u * nt);
    }
  }
  for (; j < nload; j += nt) {
    const uint4 r = __ldcs(pv + j);
    srow[j] = r;
    add(r, j);
  }
  const float M = block_max(m, scratch, -INFINITY);  // its barriers also publish srow
  const float ML = M * kLog2e, eM = log2e_residual(M, ML);
  const bool huge = ce_huge(M);  // the same for the whole block
  float st = s == 0.f ? 0.f : s * ex2_approx(ml - ML);
  if (huge) {  // Note [huge logits]: a second pass over the row in shared memory, natural units
    st = 0;
    for (int w = tid; w < nload; w += nt) {
      float v[V];
      unpack16<T>(srow[w], v);
#pragma unroll
      for (int k = 0; k < V; ++k) st += w * V + k < C ? expf(v[k] - M) : 0.f;
    }
  } else if (!isfinite(st) && isfinite(M)) {  // Note [lse to m's last bit]: this thread's words
    st = 0;
    for (int w = tid; w < nload; w += nt) {
      float v[V];
      unpack16<T>(srow[w], v);
#pragma unroll
      for (int k = 0; k < V; ++k) st += w * V + k < C ? ex2_approx(fmaf(v[k], kLog2e, -ML)) : 0.f;
    }
  }
  st = warp_sum(st);
  if (tid % 32 == 0) scratch[tid / 32] = st;
  __syncthreads();
  if (tid == 0) {
    float ss = 0;
    for (int w = 0; w < nt / 32; ++w) ss += scratch[w];  // fixed order
    const float logs = huge ? logf(ss) : (log2f(ss) - eM) * kLn2;
    const float xt = tg >= 0 && tg < C ? load_math(reinterpret_cast<const T*>(srow) + tg) : 0.f;
    ce_finish_lse<T, float, float>(row, M, logs, 0.f, xt, tg, C, ii, 0.0, lse_o, nullptr, row_loss,
                                   err);
    lse_s = M + logs;
  }
  __syncthreads();
  const float lse = lse_s, ll = lse * kLog2e, el = log2e_residual(lse, ll);
  const float sc = scale ? *scale : 1.f;
  const bool ign = tg == ii, bad = !ign && (tg < 0 || tg >= C);
  const int tgc = ign || bad ? -1 : static_cast<int>(tg);
  auto pass2 = [&](auto hg) {  // hg: Note [huge logits], natural units
    for (int w = tid; w < nv; w += nt) {
      float v[V];
      if (w < nload) {
        unpack16<T>(srow[w], v);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) v[k] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int c = w * V + k;
        float d = decltype(hg)::value ? expf(v[k] - lse) : ex2_approx(fmaf(v[k], kLog2e, -ll) - el);
        d = (c == tgc ? d - 1.f : d) * sc;
        d = bad ? NAN : d;
        v[k] = ign || c >= C ? 0.f : d;  // a select: padding / ignored logits may be inf or NaN
      }
      __stcs(pv + w, pack16<T>(v));
    }
  };
  if (ce_huge(lse)) {
    pass2(ic<1>{});
  } else {
    pass2(ic<0>{});
  }
}

// One block: count = the targets != ii, inverse = 1 / count (inf for none).
template <typename A>
__global__ void count_targets_kernel(const int64_t* __restrict__ t, int64_t N, int64_t ii,
                                     A* __restrict__ count, A* __restrict__ inverse) {
  __shared__ double scratch[32];
  double n = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) n += t[i] != ii;
  n = block_sum(n, scratch);
  if (threadIdx.x == 0) {
    *count = static_cast<A>(n);
    *inverse = static_cast<A>(1) / static_cast<A>(n);
  }
}

// One block: loss = sum (or mean over non-ignored rows) of row_loss, in a fixed order.
template <typename A, typename O>
__global__ void crossentropy_reduce(const A* __restrict__ row_loss, const int64_t* __restrict__ t,
                                    int64_t N, int64_t ii, bool mean, O* __restrict__ out) {
  __shared__ double scratch[32];
  double s = 0, cnt = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    s += static_cast<double>(row_loss[i]);
    cnt += t[i] != ii;
  }
  s = block_sum(s, scratch);
  cnt = block_sum(cnt, scratch);
  if (threadIdx.x == 0) out[0] = convert<O>(mean ? s / cnt : s);
}

}  // namespace bt::cuda::nn
