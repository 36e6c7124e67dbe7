// ln_bwd_experiments.cuh: layer-norm backward variants that lost their benchmarks in
// ln_bwd_check.cu and left the library (src/cuda/nn_fused_kernels.cuh keeps the configurations
// LayerNormBackward::eval_gpu launches).  Kept here, as they were, to be re-measured:
//  - v5 with kPf (the next row's loads issued before this row's math; the library's
//    configuration until session 12, "v5 nw8 pf (old lib)") and kCs (streaming loads / stores);
//  - v6 with CL > 1: one launch on Hopper, the blocks of a thread-block cluster summing their
//    partials through distributed shared memory and the last block to arrive writing dweight /
//    dbias (8 per cluster measured 57.5% of a D2D copy against 68.5% with the reduce kernel at
//    bf16 16384 x 768, session 12).
// In namespace experiments: the library's names (kernels, LnGrads, dispatchers, reduce kernels) are
// the enclosing namespace's.  Included after src/cuda/nn_fused_kernels.cuh.
#pragma once

#include <cooperative_groups.h>

#include "cuda/nn_fused_kernels.cuh"

namespace bt::cuda::nn::experiments {

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

// ---- v6 with thread-block clusters ------------------------------------------------------------
// blocks per cluster: 1 (the reduce kernel) to kV6MaxCluster; 16 needs the non-portable cluster
// size attribute.  Arrival counters are one per device (a __device__ array): the backward kernels
// of a device run in stream order, never two at once.
constexpr int kV6MaxCluster = 16;
__device__ unsigned int g_ln_bwd_v6_arrivals[kV6MaxCluster];

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

}  // namespace bt::cuda::nn::experiments
