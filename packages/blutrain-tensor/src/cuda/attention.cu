// cuda/attention.cu: flash attention (FlashAttention-2 style) forward and backward.
//
// Semantics (see attention.h and cpu/attention.cpp): o = softmax(q k^T * scale) v per (b, h), key
// j visible to query i iff j < S and (not causal or j <= i); lse = the rows' natural logsumexp.
// q, k, v are (B, H, L|S, D) views with any B/H/sequence strides and unit D stride; o is written
// (B, L, H, D) contiguous; dq, dk, dv where GradLayout (attention_tf32.cuh) says: (B, L|S, H, D)
// rows (contiguous, or the packed-qkv backward's single (B, T, 3 H D) gradient) or (B, H, L|S, D)
// contiguous (separate leaves of that layout); lse is (B, H, L) float32 (float64 for float64).
//
// Kernels:
//   attn_fwd_v1 / attn_bwd_*_v1  SIMT reference, any float dtype, D <= 256: one warp per row, the
//                                online softmax in float (double for float64).  fp32 uses it.
//   attn_fwd_v2                  bf16/fp16, D in {64, 128}: tensor cores (mma.sync m16n8k16,
//                                ldmatrix, fp32 accumulators), cp.async double-buffered K/V tiles,
//                                online softmax in the log2 domain; no L x S matrix in memory.
//   attn_bwd_dkdv_v2, _dq_v2     FA2's backward split in two deterministic kernels (no atomics):
//                                dK/dV per key block looping over query blocks, dQ per query block
//                                looping over key blocks; both recompute P from lse, and use
//                                Dvec = rowsum(dO * O) - dlse from attn_bwd_preprocess (v1: a
//                                warp per row; v2: 16-byte loads, D / 8 lanes per row).  kMT
//                                m-tiles per warp (register blocking) in all three; V2Config picks.
//                                Used in deterministic mode (bt::deterministic_algorithms()) and
//                                for D 128.
//   attn_bwd_dkdv_v2 with kDq    FA2's one-kernel backward (default for bf16/fp16 D 64): per
//                                key block dK, dV in registers, dQ's partials added to a float32
//                                dq_acc by red.global.add.v4.f32, then attn_bwd_dq_convert.
// On Hopper (sm_90a builds) the bf16/fp16 forward runs attention_sm90.cu (wgmma) instead of
// attn_fwd_v2, and the D 64 one-kernel backward its wgmma kernel (dQ by TMA reduce-add).  float32
// with D in {64, 128} runs attention_tf32.cu (TF32 / 3xTF32 tensor cores); other float32 / float64
// shapes run the exact SIMT kernels.
//
// Register layouts of mma.sync / ldmatrix and the swizzled tile layout: attention_mma.cuh.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>

#include "../attention.h"
#include "../autocast.h"  // float32_attention_exact: TF32 vs 3xTF32
#include "attention_mma.cuh"
#include "attention_rows.cuh"
#include "attention_tf32.cuh"
#include "common.cuh"

namespace bt::cuda {

namespace {

// ==== kernels ==================================================================================

// ---- v1: SIMT reference (any float type, D <= 256) -------------------------------------------
// One warp per row; lane holds elements d = lane + 32 i.  A: float (double for double).
constexpr int kV1Warps = 4;

template <typename T, typename A>
__device__ __forceinline__ void v1_load(A (&r)[8], const T* p, int D) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane + 32 * i;
    r[i] = d < D ? convert<A>(p[d]) : A(0);
  }
}
template <typename A>
__device__ __forceinline__ A v1_dot(const A (&x)[8], const A (&y)[8]) {
  A s = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += x[i] * y[i];
  return warp_sum(s);
}
template <typename A>
__device__ __forceinline__ A v1_exp(A x) {
  if constexpr (std::is_same_v<A, double>) {
    return exp(x);
  } else {
    return expf(x);
  }
}
template <typename A>
__device__ __forceinline__ A v1_log(A x) {
  if constexpr (std::is_same_v<A, double>) {
    return log(x);
  } else {
    return logf(x);
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(kV1Warps * 32)
    attn_fwd_v1(AttnParams p, const T* q, const T* k, const T* v, T* o, A* lse) {
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * kV1Warps + threadIdx.x / 32;
  if (row_id >= static_cast<int64_t>(p.B) * p.H * p.L) return;
  const int i = static_cast<int>(row_id % p.L);
  const int bh = static_cast<int>(row_id / p.L), b = bh / p.H, h = bh % p.H;
  const int lane = threadIdx.x % 32;
  A qv[8], acc[8], kv[8], vv[8];
  v1_load(qv, q + b * p.q_b + h * p.q_h + i * p.q_l, p.D);
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t] = 0;
  const A sc = static_cast<A>(p.scale);
  A m = -INFINITY, l = 0;
  const int n = p.causal ? min(i + 1, p.S) : p.S;
  for (int j = 0; j < n; ++j) {
    v1_load(kv, k + b * p.k_b + h * p.k_h + j * p.k_l, p.D);
    v1_load(vv, v + b * p.v_b + h * p.v_h + j * p.v_l, p.D);
    const A s = v1_dot(qv, kv) * sc;
    const A mn = max(m, s);  // (fmax: a NaN score leaves m, and its e below makes the row NaN)
    // Note [non-finite scores]: as the CPU reference (cpu/attention.cpp) and the tensor-core
    // kernels: a -inf score weighs 0, so while every score so far is -inf the base is 0, not
    // -inf (exp(-inf - -inf) = NaN would poison a row whose later scores are finite); +inf or
    // NaN in a row makes it NaN (exp(inf - inf)); a row of only -inf weighs nothing: o = 0,
    // lse -inf (Note [empty rows], attention.h).  This kernel and the CPU skip masked keys; the
    // tensor-core kernels multiply a masked key's weight 0 by its value row in the diagonal
    // tile and so recompute rows that came out non-finite (Note [non-finite rows],
    // attention_rows.cuh).
    const A base = mn == -INFINITY ? A(0) : mn;
    const A alpha = v1_exp(m - base), e = v1_exp(s - base);
    l = l * alpha + e;
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] = acc[t] * alpha + e * vv[t];
    m = mn;
  }
  T* orow = o + ((static_cast<int64_t>(b) * p.L + i) * p.H + h) * p.D;
  const A inv = A(1) / l;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int d = lane + 32 * t;
    // Note [empty rows] (attention.h): no key weighs anything (l = 0): o = 0, not 0 * v / 0
    if (d < p.D) orow[d] = convert<T>(l == A(0) ? A(0) : acc[t] * inv);
  }
  if (lane == 0) lse[row_id] = m + v1_log(l);  // (-inf for an empty row)
}

// Dvec[b, h, i] = sum_d do[b, i, h, d] * o[b, i, h, d] - dlse[b, h, i] (both backward paths; no
// dlse term when dlse is null: no gradient reached lse).
template <typename T, typename A>
__global__ void __launch_bounds__(kV1Warps * 32)
    attn_bwd_preprocess(AttnParams p, const T* o, const T* g, const A* dlse, A* dvec) {
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * kV1Warps + threadIdx.x / 32;
  if (row_id >= static_cast<int64_t>(p.B) * p.H * p.L) return;
  const int i = static_cast<int>(row_id % p.L);
  const int bh = static_cast<int>(row_id / p.L), b = bh / p.H, h = bh % p.H;
  A ov[8], gv[8];
  v1_load(ov, o + b * p.o_b + i * p.o_l + h * p.o_h, p.D);
  v1_load(gv, g + b * p.g_b + i * p.g_l + h * p.g_h, p.D);
  const A s = v1_dot(ov, gv);
  if (threadIdx.x % 32 == 0) {
    dvec[row_id] = dlse ? s - dlse[b * p.dl_b + h * p.dl_h + i * p.dl_l] : s;
  }
}

// The same, vectorised: kLpr lanes per row (kLpr = D / VW rounded up to a power of two, so D = 64
// bf16 runs 4 rows per warp), 16-byte loads of VW = 16 / sizeof(T) elements.  Needs D % VW == 0
// and 16-byte aligned rows of o and do.  With acc_zero (the fused backward's float32 dq_acc,
// (B, H, L, D) contiguous, D % 4 == 0) it also zeroes the row's accumulator: one launch and one
// pass instead of a separate memset.
template <typename T, typename A, int kLpr>
__global__ void __launch_bounds__(256)
    attn_bwd_preprocess_v2(AttnParams p, const T* o, const T* g, const A* dlse, A* dvec,
                           float* acc_zero) {
  constexpr int VW = 16 / sizeof(T);
  // On Hopper (Note [programmatic dependent launch]): this kernel may start during the tail of
  // the one that made do; and the backward kernel after it may be scheduled now: it takes a
  // whole SM, so it starts only where this kernel's blocks are done.
  grid_dependents_launch();
  grid_dependency_wait();
  const int sub = threadIdx.x % kLpr;
  const int64_t row_id = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) / kLpr;
  const bool ok = row_id < static_cast<int64_t>(p.B) * p.H * p.L;
  A s = 0;
  int b = 0, h = 0, i = 0;
  if (ok) {
    i = static_cast<int>(row_id % p.L);
    const int bh = static_cast<int>(row_id / p.L);
    b = bh / p.H, h = bh % p.H;
    const T* orow = o + b * p.o_b + i * p.o_l + h * p.o_h;
    const T* grow = g + b * p.g_b + i * p.g_l + h * p.g_h;
    for (int c = sub; c < p.D / VW; c += kLpr) {
      const uint4 ou = __ldg(reinterpret_cast<const uint4*>(orow) + c);
      const uint4 gu = __ldg(reinterpret_cast<const uint4*>(grow) + c);
      const T* oe = reinterpret_cast<const T*>(&ou);
      const T* ge = reinterpret_cast<const T*>(&gu);
#pragma unroll
      for (int e = 0; e < VW; ++e) s += convert<A>(oe[e]) * convert<A>(ge[e]);
    }
    if (acc_zero) {
      float4* arow = reinterpret_cast<float4*>(acc_zero + row_id * p.D);
      for (int c = sub; c < p.D / 4; c += kLpr) arow[c] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (row_id == 0 && sub == 0) {  // the 4 floats after the rows (launch_bwd_fused's flag)
        *reinterpret_cast<float4*>(acc_zero + static_cast<int64_t>(p.B) * p.H * p.L * p.D) =
            make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
#pragma unroll
  for (int off = kLpr / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (ok && sub == 0) dvec[row_id] = dlse ? s - dlse[b * p.dl_b + h * p.dl_h + i * p.dl_l] : s;
}

// attn_bwd_preprocess_v2 with column sums (Note [packed column sums]), 16-bit, D 64: a warp takes
// one (b, h) 16-row group, lane = (row quad rq, chunk c of 8 columns), rows 4 j + rq.  Dvec as
// attn_bwd_preprocess_v2<T, float, 8> (the same products and shuffle tree: the same bits; no dlse
// on this path).  The group's column sums of do are v's bias gradient (the sum over keys of dV is
// the sum over queries of dO: P's rows sum to 1); k's are zero (softmax ignores a per-query
// shift of the scores, which is all k's bias adds).
template <typename T>
__global__ void __launch_bounds__(256)
    attn_bwd_preprocess_cs(AttnParams p, const T* o, const T* g, float* dvec, float* acc_zero) {
  constexpr int D = 64, VW = 8;
  grid_dependents_launch();  // as attn_bwd_preprocess_v2 (Note [programmatic dependent launch])
  grid_dependency_wait();
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) / 32;
  if (warp >= static_cast<int64_t>(p.B) * p.H * p.cs_groups) return;  // whole warps
  const int lane = threadIdx.x % 32, c = lane % 8, rq = lane / 8;
  const int grp = static_cast<int>(warp % p.cs_groups), bh = static_cast<int>(warp / p.cs_groups);
  const int b = bh / p.H, h = bh % p.H;
  float cs[VW] = {};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int l = grp * 16 + 4 * j + rq;
    const bool ok = l < p.L;
    float s = 0.f;
    if (ok) {
      const T* orow = o + b * p.o_b + l * p.o_l + h * p.o_h;
      const T* grow = g + b * p.g_b + l * p.g_l + h * p.g_h;
      const uint4 ou = __ldg(reinterpret_cast<const uint4*>(orow) + c);
      const uint4 gu = __ldg(reinterpret_cast<const uint4*>(grow) + c);
      const T* oe = reinterpret_cast<const T*>(&ou);
      const T* ge = reinterpret_cast<const T*>(&gu);
#pragma unroll
      for (int e = 0; e < VW; ++e) {
        s += convert<float>(oe[e]) * convert<float>(ge[e]);
        cs[e] += convert<float>(ge[e]);
      }
      if (acc_zero) {
        float4* arow =
            reinterpret_cast<float4*>(acc_zero + (static_cast<int64_t>(bh) * p.L + l) * D);
        arow[c] = arow[c + 8] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (warp == 0 && lane == 0 && j == 0) {  // the 4 floats after the rows (the flag)
          *reinterpret_cast<float4*>(acc_zero + static_cast<int64_t>(p.B) * p.H * p.L * D) =
              make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    }
#pragma unroll
    for (int off = 4; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (ok && c == 0) dvec[static_cast<int64_t>(bh) * p.L + l] = s;
  }
#pragma unroll
  for (int e = 0; e < VW; ++e) {
    cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 8);
    cs[e] += __shfl_xor_sync(0xffffffffu, cs[e], 16);
  }
  if (rq == 0) {
    const int64_t HD = static_cast<int64_t>(p.H) * D;
    float* row = p.cs + (static_cast<int64_t>(b) * p.cs_groups + grp) * 3 * HD + h * D + c * VW;
    float4* kcols = reinterpret_cast<float4*>(row + HD);
    float4* vcols = reinterpret_cast<float4*>(row + 2 * HD);
    kcols[0] = kcols[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    vcols[0] = make_float4(cs[0], cs[1], cs[2], cs[3]);
    vcols[1] = make_float4(cs[4], cs[5], cs[6], cs[7]);
  }
}

// dq: one warp per query row, looping over the visible keys.
template <typename T, typename A>
__global__ void __launch_bounds__(kV1Warps * 32)
    attn_bwd_dq_v1(AttnParams p, const T* q, const T* k, const T* v, const T* g, const A* lse,
                   const A* dvec, T* dq) {
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * kV1Warps + threadIdx.x / 32;
  if (row_id >= static_cast<int64_t>(p.B) * p.H * p.L) return;
  const int i = static_cast<int>(row_id % p.L);
  const int bh = static_cast<int>(row_id / p.L), b = bh / p.H, h = bh % p.H;
  const int lane = threadIdx.x % 32;
  A qv[8], gv[8], kv[8], vv[8], acc[8];
  v1_load(qv, q + b * p.q_b + h * p.q_h + i * p.q_l, p.D);
  v1_load(gv, g + b * p.g_b + i * p.g_l + h * p.g_h, p.D);
#pragma unroll
  for (int t = 0; t < 8; ++t) acc[t] = 0;
  const A sc = static_cast<A>(p.scale), li = lse[row_id], di = dvec[row_id];
  // an empty row (lse -inf, Note [empty rows]) passes no gradient
  const int n = li == -INFINITY ? 0 : p.causal ? min(i + 1, p.S) : p.S;
  for (int j = 0; j < n; ++j) {
    v1_load(kv, k + b * p.k_b + h * p.k_h + j * p.k_l, p.D);
    v1_load(vv, v + b * p.v_b + h * p.v_h + j * p.v_l, p.D);
    const A pr = v1_exp(v1_dot(qv, kv) * sc - li);
    const A ds = pr * (v1_dot(gv, vv) - di);
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[t] += ds * kv[t];
  }
  T* out = dq + p.dg.dq(b, h, i);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int d = lane + 32 * t;
    if (d < p.D) out[d] = convert<T>(acc[t] * sc);
  }
}

// dk, dv: one warp per key row, looping over the queries that see it.
template <typename T, typename A>
__global__ void __launch_bounds__(kV1Warps * 32)
    attn_bwd_dkdv_v1(AttnParams p, const T* q, const T* k, const T* v, const T* g, const A* lse,
                     const A* dvec, T* dk, T* dv) {
  const int64_t row_id = static_cast<int64_t>(blockIdx.x) * kV1Warps + threadIdx.x / 32;
  if (row_id >= static_cast<int64_t>(p.B) * p.H * p.S) return;
  const int j = static_cast<int>(row_id % p.S);
  const int bh = static_cast<int>(row_id / p.S), b = bh / p.H, h = bh % p.H;
  const int lane = threadIdx.x % 32;
  A kv[8], vv[8], qv[8], gv[8], ak[8], av[8];
  v1_load(kv, k + b * p.k_b + h * p.k_h + j * p.k_l, p.D);
  v1_load(vv, v + b * p.v_b + h * p.v_h + j * p.v_l, p.D);
#pragma unroll
  for (int t = 0; t < 8; ++t) ak[t] = av[t] = 0;
  const A sc = static_cast<A>(p.scale);
  const A* lrow = lse + static_cast<int64_t>(bh) * p.L;
  const A* drow = dvec + static_cast<int64_t>(bh) * p.L;
  for (int i = p.causal ? j : 0; i < p.L; ++i) {
    if (lrow[i] == -INFINITY) continue;  // an empty row (Note [empty rows]): no gradient
    v1_load(qv, q + b * p.q_b + h * p.q_h + i * p.q_l, p.D);
    v1_load(gv, g + b * p.g_b + i * p.g_l + h * p.g_h, p.D);
    const A pr = v1_exp(v1_dot(qv, kv) * sc - lrow[i]);
    const A ds = pr * (v1_dot(gv, vv) - drow[i]);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      ak[t] += ds * qv[t];
      av[t] += pr * gv[t];
    }
  }
  const int64_t base = p.dg.kv(b, h, j);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const int d = lane + 32 * t;
    if (d < p.D) {
      dk[base + d] = convert<T>(ak[t] * sc);
      dv[base + d] = convert<T>(av[t]);
    }
  }
}

// ---- v2: tensor cores (bf16 / fp16, D in {64, 128}) -------------------------------------------
// Forward.  Block: kWarps warps, each owning kMT m-tiles of 16 query rows (kBr = 16 kMT kWarps
// rows per block; kMT = 2 reuses every K / V fragment read from shared memory twice), key tiles
// of kBc.  Grid: (B * H, ceil(L / kBr)), the last (heaviest, when causal) query blocks first.
template <typename T, int D, int kWarps, int kBc, int kMT = 1, int kMinBlocks = 1>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    attn_fwd_v2(AttnParams p, const T* __restrict__ q, const T* __restrict__ k,
                const T* __restrict__ v, T* __restrict__ o, float* __restrict__ lse) {
  constexpr int kWr = 16 * kMT, kBr = kWr * kWarps, NT = kWarps * 32, KS = D / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // kBr x D
  T* sK = sQ + kBr * D;                    // 2 x kBc x D
  T* sV = sK + 2 * kBc * D;                // 2 x kBc x D
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBr;
  const T* qb = q + b * p.q_b + h * p.q_h;
  const T* kb = k + b * p.k_b + h * p.k_h;
  const T* vb = v + b * p.v_b + h * p.v_h;
  const int kend = p.causal ? min(q0 + kBr, p.S) : p.S;
  const int nkb = (kend + kBc - 1) / kBc;

  load_tile<kBr, D, NT>(sQ, qb, p.q_l, q0, p.L);
  cp_async_commit();
  load_tile<kBc, D, NT>(sK, kb, p.k_l, 0, p.S);
  load_tile<kBc, D, NT>(sV, vb, p.v_l, 0, p.S);
  cp_async_commit();
  cp_async_wait<1>();  // Q landed
  __syncthreads();
  const int wrow = warp * kWr;  // the warp's first row in the block
  uint32_t qf[kMT][KS][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      ldsm_x4(qf[mt][ks], smem_u32(sQ + swz<D>(wrow + mt * 16 + lane % 16, ks * 2 + lane / 16)));
    }
  }
  float oacc[kMT][D / 8][4];
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) oacc[mt][i][e] = 0.f;
    }
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  const float sl2 = static_cast<float>(p.scale) * kLog2e;
  const int row_lo = q0 + wrow + g;  // rows of (mt, r): row_lo + 16 mt + 8 r

  for (int j = 0; j < nkb; ++j) {
    if (j + 1 < nkb) {
      const int nb = (j + 1) & 1;
      load_tile<kBc, D, NT>(sK + nb * kBc * D, kb, p.k_l, (j + 1) * kBc, p.S);
      load_tile<kBc, D, NT>(sV + nb * kBc * D, vb, p.v_l, (j + 1) * kBc, p.S);
    }
    cp_async_commit();
    cp_async_wait<1>();  // tile j landed
    __syncthreads();
    const T* cK = sK + (j & 1) * kBc * D;
    const T* cV = sV + (j & 1) * kBc * D;

    // S = Q K^T (kWr x kBc per warp)
    float s[kMT][kBc / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int i = 0; i < kBc / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int np = 0; np < kBc / 16; ++np) {
        uint32_t r[4];
        ldsm_x4(r, smem_u32(cK +
                            swz<D>(np * 16 + lane % 8 + 8 * (lane / 16), ks * 2 + (lane / 8) % 2)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(s[mt][2 * np], qf[mt][ks], r[0], r[1]);
          mma16816<T>(s[mt][2 * np + 1], qf[mt][ks], r[2], r[3]);
        }
      }
    }
    // masks: key tail, causal diagonal
    const int k0 = j * kBc;
    if (k0 + kBc > p.S || (p.causal && k0 + kBc - 1 > q0 + wrow)) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kBc / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + 16 * mt + (e >> 1) * 8;
            if (col >= p.S || (p.causal && col > row)) s[mt][nt][e] = -INFINITY;
          }
        }
      }
    }
    // online softmax (log2 domain), rows r = 0 (g) and 1 (g + 8) of each m-tile
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m[mt][r];
#pragma unroll
        for (int nt = 0; nt < kBc / 8; ++nt) {
          mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]) * sl2);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -INFINITY ? 0.f : mx;
        const float alpha = fast_exp2(m[mt][r] - base);
        m[mt][r] = mx;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBc / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(fmaf(s[mt][nt][2 * r + e], sl2, -base));
            s[mt][nt][2 * r + e] = pv;
            rs += pv;
          }
        }
        l[mt][r] = l[mt][r] * alpha + rs;  // per-thread partial: the quad's sum is taken at the end
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          oacc[mt][dt][2 * r] *= alpha;
          oacc[mt][dt][2 * r + 1] *= alpha;
        }
      }
    }
    // O += P V
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t r[4];
        ldsm_x4_t(r, smem_u32(cV + swz<D>(kk * 16 + lane % 16, dp * 2 + lane / 16)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(oacc[mt][2 * dp], a[mt], r[0], r[1]);
          mma16816<T>(oacc[mt][2 * dp + 1], a[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();  // the next iteration refills this buffer
  }

#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[mt][r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int row = row_lo + 16 * mt + 8 * r;
      bool bad = false;
      if (row < p.L) {
        const float inv = lr == 0.f ? 0.f : 1.f / lr;  // an empty row: o = 0, lse -inf
        T* orow = o + ((static_cast<int64_t>(b) * p.L + row) * p.H + h) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          const uint32_t w = pack2<T>(oacc[mt][dt][2 * r] * inv, oacc[mt][dt][2 * r + 1] * inv);
          bad |= pair_nonfinite<T>(w);
          *reinterpret_cast<uint32_t*>(orow + dt * 8 + 2 * t) = w;
        }
        if (t == 0) lse[static_cast<int64_t>(bh) * p.L + row] = (m[mt][r] + log2f(lr)) * kLn2;
      }
      for_bad_rows(bad, [&](int gb) {  // Note [non-finite rows] (attention_rows.cuh)
        const int rb = row - g + gb;
        const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
        fix_o_row<T>(ra, qb, kb, vb, rb, o + ((static_cast<int64_t>(b) * p.L + rb) * p.H + h) * D,
                     lse + static_cast<int64_t>(bh) * p.L + rb);
      });
    }
  }
}

template <int kBr, int kWarps, int D>
struct FusedDqSplit {  // dQ stage: each warp owns kM m-tiles (16 queries) x kN columns of D
  static constexpr int kTiles = kBr / 16;
  static constexpr int kM = kTiles >= kWarps ? kTiles / kWarps : 1;
  static constexpr int kN = kTiles >= kWarps ? D : D * kTiles / kWarps;
};

// Backward, dK and dV.  Block: kWarps warps own kBc = 16 kMT kWarps keys (kMT m-tiles of 16 keys
// per warp: every Q / dO fragment read from shared memory feeds kMT MMAs) and loop over query
// tiles of kBr rows (double-buffered Q, dO, lse, Dvec).  Per tile, per warp (keys as M):
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - Dvec),
//   dV += P^T dO, dK += dS^T Q (times scale at the end).
// kFrag: keep the warp's K and V A-fragments in registers (else re-read them from shared memory).
// kDq (FA2's one-kernel backward, the default outside determinism mode for D 64): also dQ's
// partial dS K for each tile: dS^T goes to shared memory (kBc x (kBr + 8), padded rows:
// conflict-free 32-bit stores and ldmatrix), then the block's warps split the tile's kBr x D
// product dS K and add it to the float32 dq_acc (B, H, L, D) with red.global.add.v4.f32 (lanes
// t, t ^ 1 swap halves of their C fragments so each holds 4 adjacent columns of one row;
// attn_bwd_dq_convert scales and converts dq_acc): 5 GEMM-equivalents per tile pair instead of
// the split's 7, not deterministic (atomic order).  kGroupBh: consecutive blocks take the key
// blocks of one (b, h) (their atomics hit one L2-resident dq_acc slice) instead of one key
// block of consecutive heads (the heaviest causal key blocks first).
template <typename T, int D, int kWarps, int kBr, bool kFrag, int kMinBlocks = 1, int kMT = 1,
          bool kDq = false, bool kGroupBh = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    attn_bwd_dkdv_v2(AttnParams p, const T* __restrict__ q, const T* __restrict__ k,
                     const T* __restrict__ v, const T* __restrict__ gr,
                     const float* __restrict__ lse, const float* __restrict__ dvec,
                     T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc) {
  constexpr int kWk = 16 * kMT, kBc = kWk * kWarps, NT = kWarps * 32, KS = D / 16;
  constexpr int kRs = kBr + 8;  // sDS row stride (elements)
  using Split = FusedDqSplit<kBr, kWarps, D>;
  constexpr int kDM = Split::kM, kDN = Split::kN;
  static_assert(!kDq || (((kBr / 16) / kDM) * (D / kDN) == kWarps && kDN % 16 == 0), "dQ split");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);                  // kBc x D
  T* sV = sK + kBc * D;                                    // kBc x D
  T* sQ = sV + kBc * D;                                    // 2 x kBr x D
  T* sG = sQ + 2 * kBr * D;                                // 2 x kBr x D
  float* sL = reinterpret_cast<float*>(sG + 2 * kBr * D);  // 2 x kBr
  float* sD = sL + 2 * kBr;                                // 2 x kBr
  T* sDS = reinterpret_cast<T*>(sD + 2 * kBr);             // kBc x kRs: dS^T (keys x queries)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // grid (B H, key blocks), launched x fastest: key block 0 (when causal, the most query tiles)
  // of every head first; kGroupBh renumbers the blocks so one head's key blocks run together
  int bh = blockIdx.x, kblk = blockIdx.y;
  if constexpr (kGroupBh) {
    const int64_t lin = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
    bh = static_cast<int>(lin / gridDim.y), kblk = static_cast<int>(lin % gridDim.y);
  }
  const int b = bh / p.H, h = bh % p.H;
  const int k0 = kblk * kBc;
  const T* qb = q + b * p.q_b + h * p.q_h;
  const T* kb = k + b * p.k_b + h * p.k_h;
  const T* vb = v + b * p.v_b + h * p.v_h;
  const T* gb = gr + b * p.g_b + h * p.g_h;  // do rows: stride g_l
  const float* lb = lse + static_cast<int64_t>(bh) * p.L;
  const float* db = dvec + static_cast<int64_t>(bh) * p.L;
  float* accb = kDq ? dq_acc + static_cast<int64_t>(bh) * p.L * D : nullptr;
  const int i_begin = p.causal ? k0 / kBr : 0;
  const int i_end = (p.L + kBr - 1) / kBr;

  load_tile<kBc, D, NT>(sK, kb, p.k_l, k0, p.S);
  load_tile<kBc, D, NT>(sV, vb, p.v_l, k0, p.S);
  cp_async_commit();
  auto load_q = [&](int i, int buf) {
    load_tile<kBr, D, NT>(sQ + buf * kBr * D, qb, p.q_l, i * kBr, p.L);
    load_tile<kBr, D, NT>(sG + buf * kBr * D, gb, p.g_l, i * kBr, p.L);
    load_vec<kBr, NT>(sL + buf * kBr, lb, i * kBr, p.L);
    load_vec<kBr, NT>(sD + buf * kBr, db, i * kBr, p.L);
  };
  if (i_begin < i_end) load_q(i_begin, 0);
  cp_async_commit();
  cp_async_wait<1>();  // K, V landed
  __syncthreads();
  const int wkey = warp * kWk;  // the warp's first key in the block
  uint32_t kf[kFrag ? kMT : 1][kFrag ? KS : 1][4], vf[kFrag ? kMT : 1][kFrag ? KS : 1][4];
  if constexpr (kFrag) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        const int row = wkey + mt * 16 + lane % 16, ch = ks * 2 + lane / 16;
        ldsm_x4(kf[mt][ks], smem_u32(sK + swz<D>(row, ch)));
        ldsm_x4(vf[mt][ks], smem_u32(sV + swz<D>(row, ch)));
      }
    }
  }
  float dka[kMT][D / 8][4], dva[kMT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dka[mt][i][e] = dva[mt][i][e] = 0.f;
    }
  }
  const float sl2 = static_cast<float>(p.scale) * kLog2e;
  const int key_lo = k0 + wkey + g;  // keys of (mt, r): key_lo + 16 mt + 8 r
  // dQ stage: the warp's m-tiles [dm0, dm0 + kDM) of the query tile, columns [dn0, dn0 + kDN)
  const int dm0 = (warp / (D / kDN)) * kDM, dn0 = (warp % (D / kDN)) * kDN;

  for (int i = i_begin; i < i_end; ++i) {
    const int buf = (i - i_begin) & 1;
    if (i + 1 < i_end) load_q(i + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* cQ = sQ + buf * kBr * D;
    const T* cG = sG + buf * kBr * D;
    const float* cL = sL + buf * kBr;
    const float* cD = sD + buf * kBr;

    float s[kMT][kBr / 8][4], dpv[kMT][kBr / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < kBr / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = dpv[mt][n][e] = 0.f;
      }
    }
    // S^T = K Q^T, dP^T = V dO^T (keys as M)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      uint32_t ka[kMT][4], va[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (kFrag) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            ka[mt][e] = kf[mt][ks][e];
            va[mt][e] = vf[mt][ks][e];
          }
        } else {
          const int row = wkey + mt * 16 + lane % 16, ch = ks * 2 + lane / 16;
          ldsm_x4(ka[mt], smem_u32(sK + swz<D>(row, ch)));
          ldsm_x4(va[mt], smem_u32(sV + swz<D>(row, ch)));
        }
      }
#pragma unroll
      for (int np = 0; np < kBr / 16; ++np) {
        const int row = np * 16 + lane % 8 + 8 * (lane / 16), ch = ks * 2 + (lane / 8) % 2;
        uint32_t r[4];
        ldsm_x4(r, smem_u32(cQ + swz<D>(row, ch)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(s[mt][2 * np], ka[mt], r[0], r[1]);
          mma16816<T>(s[mt][2 * np + 1], ka[mt], r[2], r[3]);
        }
        ldsm_x4(r, smem_u32(cG + swz<D>(row, ch)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(dpv[mt][2 * np], va[mt], r[0], r[1]);
          mma16816<T>(dpv[mt][2 * np + 1], va[mt], r[2], r[3]);
        }
      }
    }
    // P^T and dS^T; element (mt, n, e): key key_lo + 16 mt + 8 (e / 2), query
    // i kBr + 8 n + 2 t + e % 2.  dS^T (the MMA operand, rounded to T) also goes to sDS.
    const int qi0 = i * kBr;
    // (key tail too: dS must be 0 there, it feeds dQ)
    const bool need_mask =
        qi0 + kBr > p.L || (kDq && k0 + kBc > p.S) || (p.causal && qi0 < k0 + kBc);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < kBr / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = n * 8 + 2 * t + (e & 1);
          float pv = fast_exp2(fmaf(s[mt][n][e], sl2, -cL[c] * kLog2e));
          if (need_mask) {
            const int qq = qi0 + c, key = key_lo + 16 * mt + 8 * (e >> 1);
            if (qq >= p.L || (kDq && key >= p.S) || (p.causal && qq < key)) pv = 0.f;
          }
          s[mt][n][e] = pv;
          dpv[mt][n][e] = pv * (dpv[mt][n][e] - cD[c]);
        }
        if constexpr (kDq) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            *reinterpret_cast<uint32_t*>(sDS + (wkey + 16 * mt + g + 8 * r) * kRs + n * 8 + 2 * t) =
                pack2<T>(dpv[mt][n][2 * r], dpv[mt][n][2 * r + 1]);
          }
        }
      }
    }
    // dV += P^T dO, dK += dS^T Q (queries as k)
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t pa[kMT][4], da[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        pa[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        da[mt][0] = pack2<T>(dpv[mt][2 * kk][0], dpv[mt][2 * kk][1]);
        da[mt][1] = pack2<T>(dpv[mt][2 * kk][2], dpv[mt][2 * kk][3]);
        da[mt][2] = pack2<T>(dpv[mt][2 * kk + 1][0], dpv[mt][2 * kk + 1][1]);
        da[mt][3] = pack2<T>(dpv[mt][2 * kk + 1][2], dpv[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        const int row = kk * 16 + lane % 16, ch = dp * 2 + lane / 16;
        uint32_t r[4];
        ldsm_x4_t(r, smem_u32(cG + swz<D>(row, ch)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(dva[mt][2 * dp], pa[mt], r[0], r[1]);
          mma16816<T>(dva[mt][2 * dp + 1], pa[mt], r[2], r[3]);
        }
        ldsm_x4_t(r, smem_u32(cQ + swz<D>(row, ch)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(dka[mt][2 * dp], da[mt], r[0], r[1]);
          mma16816<T>(dka[mt][2 * dp + 1], da[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();  // (kDq: sDS complete)
    if constexpr (kDq) {
      // dQ_tile = dS K (kBr x D; keys as k): A = dS[q][key] = sDS[key][q] (ldmatrix .trans of the
      // key-major tile), B = K[key][d] (sK, key-major: .trans)
      {
        float dqa[kDM][kDN / 8][4];
#pragma unroll
        for (int mq = 0; mq < kDM; ++mq) {
#pragma unroll
          for (int n = 0; n < kDN / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dqa[mq][n][e] = 0.f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < kBc / 16; ++kk) {
          uint32_t a[kDM][4];
#pragma unroll
          for (int mq = 0; mq < kDM; ++mq) {
            const int key = kk * 16 + lane % 8 + 8 * (lane / 16);
            const int qc = (dm0 + mq) * 16 + 8 * ((lane / 8) % 2);
            ldsm_x4_t(a[mq], smem_u32(sDS + key * kRs + qc));
          }
#pragma unroll
          for (int dp = 0; dp < kDN / 16; ++dp) {
            uint32_t r[4];
            ldsm_x4_t(r, smem_u32(sK + swz<D>(kk * 16 + lane % 16, dn0 / 8 + dp * 2 + lane / 16)));
#pragma unroll
            for (int mq = 0; mq < kDM; ++mq) {
              mma16816<T>(dqa[mq][2 * dp], a[mq], r[0], r[1]);
              mma16816<T>(dqa[mq][2 * dp + 1], a[mq], r[2], r[3]);
            }
          }
        }
        const bool odd = t & 1;  // (red_add_c_tile: the odd lane adds row g + 8)
#pragma unroll
        for (int mq = 0; mq < kDM; ++mq) {
          const int qq = qi0 + (dm0 + mq) * 16 + g + (odd ? 8 : 0);
          float* dst = accb + static_cast<int64_t>(qq) * D + dn0 + 2 * (t & 2);
#pragma unroll
          for (int n = 0; n < kDN / 8; ++n) {
            const float* c = dqa[mq][n];
            red_add_c_tile(dst + n * 8, c[0], c[1], c[2], c[3], odd, qq < p.L);
          }
        }
      }
      __syncthreads();  // the next iteration refills this Q / dO buffer and sDS
    }
  }

  const float sc = static_cast<float>(p.scale);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key_lo + 16 * mt + 8 * r;
      bool bad = false;
      if (key < p.S) {
        const int64_t base = p.dg.kv(b, h, key);
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          const uint32_t wk = pack2<T>(dka[mt][dt][2 * r] * sc, dka[mt][dt][2 * r + 1] * sc);
          const uint32_t wv = pack2<T>(dva[mt][dt][2 * r], dva[mt][dt][2 * r + 1]);
          bad |= pair_nonfinite<T>(wk) || pair_nonfinite<T>(wv);
          *reinterpret_cast<uint32_t*>(dk + base + dt * 8 + 2 * t) = wk;
          *reinterpret_cast<uint32_t*>(dv + base + dt * 8 + 2 * t) = wv;
        }
      }
      for_bad_rows(bad, [&](int gi) {  // Note [non-finite rows] (attention_rows.cuh)
        const int kj = key - g + gi;
        const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
        fix_dkdv_row<T>(ra, qb, kb, vb, gb, lse + static_cast<int64_t>(bh) * p.L,
                        dvec + static_cast<int64_t>(bh) * p.L, kj, dk + p.dg.kv(b, h, kj),
                        dv + p.dg.kv(b, h, kj));
      });
    }
  }
}

// Backward, dQ.  Block: kWarps warps own kBr = 16 kMT kWarps queries (kMT m-tiles of 16 per
// warp: every K / V fragment read from shared memory feeds kMT MMAs) and loop over key tiles of
// kBc (double-buffered K, V).  Per tile, per warp: S = Q K^T, dP = dO V^T,
// P = exp(S scale - lse), dS = P (dP - Dvec), dQ += dS K (times scale at the end).
template <typename T, int D, int kWarps, int kBc, int kMinBlocks = 1, int kMT = 1>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    attn_bwd_dq_v2(AttnParams p, const T* __restrict__ q, const T* __restrict__ k,
                   const T* __restrict__ v, const T* __restrict__ gr, const float* __restrict__ lse,
                   const float* __restrict__ dvec, T* __restrict__ dq) {
  constexpr int kWr = 16 * kMT, kBr = kWr * kWarps, NT = kWarps * 32, KS = D / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // kBr x D
  T* sG = sQ + kBr * D;                    // kBr x D
  T* sK = sG + kBr * D;                    // 2 x kBc x D
  T* sV = sK + 2 * kBc * D;                // 2 x kBc x D
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBr;
  const T* qb = q + b * p.q_b + h * p.q_h;
  const T* kb = k + b * p.k_b + h * p.k_h;
  const T* vb = v + b * p.v_b + h * p.v_h;
  const T* gb = gr + b * p.g_b + h * p.g_h;
  const int kend = p.causal ? min(q0 + kBr, p.S) : p.S;
  const int nkb = (kend + kBc - 1) / kBc;

  load_tile<kBr, D, NT>(sQ, qb, p.q_l, q0, p.L);
  load_tile<kBr, D, NT>(sG, gb, p.g_l, q0, p.L);
  cp_async_commit();
  load_tile<kBc, D, NT>(sK, kb, p.k_l, 0, p.S);
  load_tile<kBc, D, NT>(sV, vb, p.v_l, 0, p.S);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  const int wrow = warp * kWr;  // the warp's first query in the block
  uint32_t qf[kMT][KS][4], gf[kMT][KS][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int row = wrow + mt * 16 + lane % 16, ch = ks * 2 + lane / 16;
      ldsm_x4(qf[mt][ks], smem_u32(sQ + swz<D>(row, ch)));
      ldsm_x4(gf[mt][ks], smem_u32(sG + swz<D>(row, ch)));
    }
  }
  const int row_lo = q0 + wrow + g;  // rows of (mt, r): row_lo + 16 mt + 8 r
  float lse2[kMT][2], dvr[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + 16 * mt + 8 * r;
      const bool ok = row < p.L;
      lse2[mt][r] = ok ? lse[static_cast<int64_t>(bh) * p.L + row] * kLog2e : 0.f;
      dvr[mt][r] = ok ? dvec[static_cast<int64_t>(bh) * p.L + row] : 0.f;
    }
  }
  float dqa[kMT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dqa[mt][i][e] = 0.f;
    }
  }
  const float sl2 = static_cast<float>(p.scale) * kLog2e;

  for (int j = 0; j < nkb; ++j) {
    if (j + 1 < nkb) {
      const int nb = (j + 1) & 1;
      load_tile<kBc, D, NT>(sK + nb * kBc * D, kb, p.k_l, (j + 1) * kBc, p.S);
      load_tile<kBc, D, NT>(sV + nb * kBc * D, vb, p.v_l, (j + 1) * kBc, p.S);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* cK = sK + (j & 1) * kBc * D;
    const T* cV = sV + (j & 1) * kBc * D;

    float s[kMT][kBc / 8][4], dpv[kMT][kBc / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < kBc / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = dpv[mt][n][e] = 0.f;
      }
    }
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int np = 0; np < kBc / 16; ++np) {
        const int row = np * 16 + lane % 8 + 8 * (lane / 16), ch = ks * 2 + (lane / 8) % 2;
        uint32_t r[4];
        ldsm_x4(r, smem_u32(cK + swz<D>(row, ch)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(s[mt][2 * np], qf[mt][ks], r[0], r[1]);
          mma16816<T>(s[mt][2 * np + 1], qf[mt][ks], r[2], r[3]);
        }
        ldsm_x4(r, smem_u32(cV + swz<D>(row, ch)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(dpv[mt][2 * np], gf[mt][ks], r[0], r[1]);
          mma16816<T>(dpv[mt][2 * np + 1], gf[mt][ks], r[2], r[3]);
        }
      }
    }
    const int k0 = j * kBc;
    const bool need_mask = k0 + kBc > p.S || (p.causal && k0 + kBc - 1 > q0 + wrow);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int n = 0; n < kBc / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float pv = fast_exp2(fmaf(s[mt][n][e], sl2, -lse2[mt][r]));
          if (need_mask) {
            const int col = k0 + n * 8 + 2 * t + (e & 1), row = row_lo + 16 * mt + 8 * r;
            if (col >= p.S || (p.causal && col > row)) pv = 0.f;
          }
          dpv[mt][n][e] = pv * (dpv[mt][n][e] - dvr[mt][r]);
        }
      }
    }
    // dQ += dS K (keys as k)
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t da[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        da[mt][0] = pack2<T>(dpv[mt][2 * kk][0], dpv[mt][2 * kk][1]);
        da[mt][1] = pack2<T>(dpv[mt][2 * kk][2], dpv[mt][2 * kk][3]);
        da[mt][2] = pack2<T>(dpv[mt][2 * kk + 1][0], dpv[mt][2 * kk + 1][1]);
        da[mt][3] = pack2<T>(dpv[mt][2 * kk + 1][2], dpv[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t r[4];
        ldsm_x4_t(r, smem_u32(cK + swz<D>(kk * 16 + lane % 16, dp * 2 + lane / 16)));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(dqa[mt][2 * dp], da[mt], r[0], r[1]);
          mma16816<T>(dqa[mt][2 * dp + 1], da[mt], r[2], r[3]);
        }
      }
    }
    __syncthreads();
  }

  const float sc = static_cast<float>(p.scale);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_lo + 16 * mt + 8 * r;
      bool bad = false;
      if (row < p.L) {
        T* out = dq + p.dg.dq(b, h, row);
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          const uint32_t w = pack2<T>(dqa[mt][dt][2 * r] * sc, dqa[mt][dt][2 * r + 1] * sc);
          bad |= pair_nonfinite<T>(w);
          *reinterpret_cast<uint32_t*>(out + dt * 8 + 2 * t) = w;
        }
      }
      for_bad_rows(bad, [&](int gi) {  // Note [non-finite rows] (attention_rows.cuh)
        const int ri = row - g + gi;
        const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
        fix_dq_row<T>(ra, qb, kb, vb, gb, lse + static_cast<int64_t>(bh) * p.L,
                      dvec + static_cast<int64_t>(bh) * p.L, ri, dq + p.dg.dq(b, h, ri));
      });
    }
  }
}

// What the conversions need to recompute rows (Note [non-finite rows]): dq's, and the key rows of
// dk / dv when the Hopper backward set *bad_keys (Note [no calls in wgmma kernels]).
template <typename T>
struct DqFixInputs {
  const T *q, *k, *v, *g;
  const float *lse, *dvec;
  T *dk, *dv;
  const int* bad_keys;  // null: no flag (the caller's backward recomputed its own rows)
};
template <typename T>
__device__ __forceinline__ void fix_dq_of(const AttnParams& p, const DqFixInputs<T>& in,
                                          T* __restrict__ dq, int64_t row) {  // (b, h, l)
  const int l = static_cast<int>(row % p.L), bh = static_cast<int>(row / p.L);
  const int b = bh / p.H, h = bh % p.H;
  const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
  fix_dq_row<T>(ra, in.q + b * p.q_b + h * p.q_h, in.k + b * p.k_b + h * p.k_h,
                in.v + b * p.v_b + h * p.v_h, in.g + b * p.g_b + h * p.g_h,
                in.lse + static_cast<int64_t>(bh) * p.L, in.dvec + static_cast<int64_t>(bh) * p.L,
                l, dq + p.dg.dq(b, h, l));
}

// The bad rows of a convert warp (D / 8 lanes a row), out of line: the kernel stays light.
template <typename T, int D>
__device__ __noinline__ void fix_convert_rows(const AttnParams& p, const DqFixInputs<T>& fix, T* dq,
                                              int64_t idx, bool bad) {
  for_bad_rows<D / 8>(
      bad, [&](int gi) { fix_dq_of<T>(p, fix, dq, (idx - threadIdx.x % 32) / (D / 8) + gi); });
}
// A convert_cs warp's column sums s (its lanes' 8 columns; rows 4 j + rq, added over rq by xor 8,
// 16) into partial row b cs_groups + grp of p.cs (Note [packed column sums]).
__device__ __forceinline__ void store_group_sums(const AttnParams& p, float (&s)[8], int b, int h,
                                                 int grp) {
  constexpr int D = 64;
  const int lane = threadIdx.x % 32, d = (lane % 8) * 8;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 8);
    s[i] += __shfl_xor_sync(0xffffffffu, s[i], 16);
  }
  if (lane / 8 == 0) {
    float* out = p.cs + (static_cast<int64_t>(b) * p.cs_groups + grp) * 3 * p.H * D + h * D + d;
    reinterpret_cast<float4*>(out)[0] = make_float4(s[0], s[1], s[2], s[3]);
    reinterpret_cast<float4*>(out)[1] = make_float4(s[4], s[5], s[6], s[7]);
  }
}

// The bad rows of a convert_cs warp: rows grp 16 + 4 j + rq, bit j of `bad`.
template <typename T>
__device__ __noinline__ void fix_convert_cs_rows(const AttnParams& p, const DqFixInputs<T>& fix,
                                                 T* dq, int bh, int grp, unsigned bad) {
  const int lane = threadIdx.x % 32, d = (lane % 8) * 8, rq = lane / 8;
  const int b = bh / p.H, h = bh % p.H;
  for (int j = 0; j < 4; ++j) {
    for_bad_rows<8>((bad >> j) & 1u, [&](int gi) {
      fix_dq_of<T>(p, fix, dq, static_cast<int64_t>(bh) * p.L + grp * 16 + 4 * j + gi);
    });
  }
  // the group's column sums as attn_bwd_dq_convert_cs takes them, over the stored rows
  float s[8] = {};
  for (int j = 0; j < 4; ++j) {
    const int l = grp * 16 + 4 * j + rq;
    if (l < p.L) {
      const uint4 u = *reinterpret_cast<const uint4*>(dq + p.dg.dq(b, h, l) + d);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(w[i]);
        s[2 * i] += f.x, s[2 * i + 1] += f.y;
      }
    }
  }
  store_group_sums(p, s, b, h, grp);
}

// The Hopper backward flagged a key row that is not finite: warp w of nwarps checks key rows w,
// w + nwarps, ... of dk and dv and recomputes the bad ones (rare: a cost only then).
template <typename T>
__device__ __noinline__ void fix_flagged_keys(const AttnParams& p, const DqFixInputs<T>& in,
                                              int64_t warp, int64_t nwarps) {
  const int lane = threadIdx.x % 32;
  const int64_t keys = static_cast<int64_t>(p.B) * p.H * p.S;
  const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
  for (int64_t r = warp; r < keys; r += nwarps) {
    const int j = static_cast<int>(r % p.S), bh = static_cast<int>(r / p.S);
    const int b = bh / p.H, h = bh % p.H;
    T* dkr = in.dk + p.dg.kv(b, h, j);
    T* dvr = in.dv + p.dg.kv(b, h, j);
    bool bad = false;
    for (int d = lane; d < p.D; d += 32) {
      bad |= !isfinite(static_cast<float>(dkr[d])) || !isfinite(static_cast<float>(dvr[d]));
    }
    if (__any_sync(0xffffffffu, bad)) {
      __syncwarp();
      fix_dkdv_row<T>(ra, in.q + b * p.q_b + h * p.q_h, in.k + b * p.k_b + h * p.k_h,
                      in.v + b * p.v_b + h * p.v_h, in.g + b * p.g_b + h * p.g_h,
                      in.lse + static_cast<int64_t>(bh) * p.L,
                      in.dvec + static_cast<int64_t>(bh) * p.L, j, dkr, dvr);
      __syncwarp();
    }
  }
}

// dq[b, h, l, :] (where p.dg says) = dq_acc[b, h, l, :] * scale as T; 8 elements a thread, D / 8
// lanes a row; a row with a non-finite value is recomputed (Note [non-finite rows]).  p and fix
// are __grid_constant__: the fix paths take them by reference, which otherwise copies both to
// every thread's stack (568 bytes a thread: 3x the kernel's time, session 50).
template <typename T, int D>
__global__ void __launch_bounds__(256, 8)  // (its registers as before the fix path)
    attn_bwd_dq_convert(const __grid_constant__ AttnParams p, const float* __restrict__ acc,
                        T* __restrict__ dq, const __grid_constant__ DqFixInputs<T> fix) {
  grid_dependency_wait();  // acc comes from the backward kernel before
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  const int64_t total = static_cast<int64_t>(p.B) * p.H * p.L * (D / 8);
  if (idx - threadIdx.x % 32 >= total) return;  // whole warps (for_bad_rows below)
  bool bad = false;
  if (idx < total) {
    const int d = static_cast<int>(idx % (D / 8)) * 8;
    const int64_t row = idx / (D / 8);  // (b, h, l)
    const int l = static_cast<int>(row % p.L), bh = static_cast<int>(row / p.L);
    const int b = bh / p.H, h = bh % p.H;
    const float4 x0 = __ldg(reinterpret_cast<const float4*>(acc + row * D + d));
    const float4 x1 = __ldg(reinterpret_cast<const float4*>(acc + row * D + d) + 1);
    const float sc = static_cast<float>(p.scale);
    uint32_t* out = reinterpret_cast<uint32_t*>(dq + p.dg.dq(b, h, l) + d);
    const uint32_t w[4] = {pack2<T>(x0.x * sc, x0.y * sc), pack2<T>(x0.z * sc, x0.w * sc),
                           pack2<T>(x1.x * sc, x1.y * sc), pack2<T>(x1.z * sc, x1.w * sc)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      bad |= pair_nonfinite<T>(w[i]);
      out[i] = w[i];
    }
  }
  if (__any_sync(0xffffffffu, bad)) fix_convert_rows<T, D>(p, fix, dq, idx, bad);
  if (fix.bad_keys && *fix.bad_keys) {
    fix_flagged_keys<T>(p, fix, idx / 32, (total + 31) / 32);
  }
}

// attn_bwd_dq_convert with column sums (Note [packed column sums]), D 64: a warp converts one
// (b, h) 16-row group, lane = (row quad rq, 8-column chunk), rows 4 j + rq; the group's sums of
// the rounded values (lanes of one chunk added by xor 8, 16) go to partial row b cs_groups + group.
template <typename T>
__global__ void __launch_bounds__(256, 6)  // (its registers as before the fix path)
    attn_bwd_dq_convert_cs(const __grid_constant__ AttnParams p, const float* __restrict__ acc,
                           T* __restrict__ dq, const __grid_constant__ DqFixInputs<T> fix) {
  constexpr int D = 64;
  grid_dependency_wait();  // acc comes from the backward kernel before
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) / 32;
  if (warp >= static_cast<int64_t>(p.B) * p.H * p.cs_groups) return;  // whole warps
  const int lane = threadIdx.x % 32, d = (lane % 8) * 8, rq = lane / 8;
  const int grp = static_cast<int>(warp % p.cs_groups), bh = static_cast<int>(warp / p.cs_groups);
  const int b = bh / p.H, h = bh % p.H;
  const float sc = static_cast<float>(p.scale);
  float s[8] = {};
  unsigned bad = 0;  // bit j: row grp 16 + 4 j + rq has a non-finite value
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int l = grp * 16 + 4 * j + rq;
    if (l < p.L) {
      const float* src = acc + (static_cast<int64_t>(bh) * p.L + l) * D + d;
      const float4 x0 = __ldg(reinterpret_cast<const float4*>(src));
      const float4 x1 = __ldg(reinterpret_cast<const float4*>(src) + 1);
      const uint32_t w[4] = {pack2<T>(x0.x * sc, x0.y * sc), pack2<T>(x0.z * sc, x0.w * sc),
                             pack2<T>(x1.x * sc, x1.y * sc), pack2<T>(x1.z * sc, x1.w * sc)};
      *reinterpret_cast<uint4*>(dq + p.dg.dq(b, h, l) + d) = make_uint4(w[0], w[1], w[2], w[3]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = unpack2<T>(w[i]);
        s[2 * i] += f.x, s[2 * i + 1] += f.y;
        if (pair_nonfinite<T>(w[i])) bad |= 1u << j;
      }
    }
  }
  // Note [non-finite rows]: (warp-uniform) recompute bad rows, then the sums over stored rows
  if (__any_sync(0xffffffffu, bad != 0)) {
    fix_convert_cs_rows<T>(p, fix, dq, bh, grp, bad);  // (and the group's sums)
  } else {
    store_group_sums(p, s, b, h, grp);
  }
  if (fix.bad_keys && *fix.bad_keys) {
    fix_flagged_keys<T>(p, fix, warp, static_cast<int64_t>(p.B) * p.H * p.cs_groups);
  }
}

// ---- configurations ----------------------------------------------------------------------------
// Forward: 16 kFwdMT kFwdWarps query rows per block, kFwdBc keys per tile.  Backward dK/dV:
// 16 kKvMT kKvWarps keys per block, kKvBr queries per tile; dQ: 16 kDqMT kDqWarps queries per
// block, kDqBc keys per tile; fused (v3): as dK/dV (kFu*).  *MinBlocks: __launch_bounds__ min
// blocks per SM.  bench/attn_tune.cu sweeps these (it prints its best as lines to paste here).
template <int D>
struct V2Config;
template <>
struct V2Config<64> {
  static constexpr int kFwdWarps = 4, kFwdBc = 64, kFwdMT = 2, kFwdMinBlocks = 1;
  static constexpr int kKvWarps = 4, kKvBr = 32, kKvMT = 2, kKvMinBlocks = 1;  // tuned: 0.266 ms
  static constexpr bool kKvFrag = false;
  static constexpr int kDqWarps = 4, kDqBc = 64, kDqMT = 2, kDqMinBlocks = 1;  // tuned: 0.177 ms
  static constexpr int kFuWarps = 4, kFuBr = 32, kFuMT = 2, kFuMinBlocks = 1;  // tuned: 0.408 ms
  static constexpr bool kFuFrag = false, kFuGroupBh = false;
};
template <>
struct V2Config<128> {
  static constexpr int kFwdWarps = 4, kFwdBc = 64, kFwdMT = 1, kFwdMinBlocks = 1;
  static constexpr int kKvWarps = 4, kKvBr = 64, kKvMT = 1, kKvMinBlocks = 1;  // tuned: 0.473 ms
  static constexpr bool kKvFrag = false;
  static constexpr int kDqWarps = 4, kDqBc = 64, kDqMT = 1, kDqMinBlocks = 1;
  // fused: 0.849 ms, slower than dkdv + dq (0.82 ms) at B16 H12 T1024: D 128 runs the split
  static constexpr int kFuWarps = 4, kFuBr = 64, kFuMT = 1, kFuMinBlocks = 1;
  static constexpr bool kFuFrag = false, kFuGroupBh = false;
};

// Shared-memory bytes of each kernel (launchers and bench/attn_tune.cu).
template <typename T, int D, int kWarps, int kBc, int kMT>
constexpr size_t fwd_smem() {
  return (16 * kMT * kWarps * D + 4 * kBc * D) * sizeof(T);
}
template <typename T, int D, int kWarps, int kBr, int kMT>
constexpr size_t dkdv_smem() {
  return (2 * 16 * kMT * kWarps * D + 4 * kBr * D) * sizeof(T) + 4 * kBr * sizeof(float);
}
template <typename T, int D, int kWarps, int kBc, int kMT>
constexpr size_t dq_smem() {
  return (2 * 16 * kMT * kWarps * D + 4 * kBc * D) * sizeof(T);
}
template <typename T, int D, int kWarps, int kBr, int kMT>
constexpr size_t fused_smem() {
  return dkdv_smem<T, D, kWarps, kBr, kMT>() + 16 * kMT * kWarps * (kBr + 8) * sizeof(T);
}

}  // namespace

#ifndef BT_ATTENTION_KERNELS_ONLY  // (a standalone kernel test includes the kernels only)
// ==== launchers ================================================================================

namespace {

AttnParams make_params(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                       bool causal) {
  AttnParams p{};
  p.B = static_cast<int>(q.size(0));
  p.H = static_cast<int>(q.size(1));
  p.L = static_cast<int>(q.size(2));
  p.D = static_cast<int>(q.size(3));
  p.S = static_cast<int>(k.size(2));
  p.q_b = q.strides()[0], p.q_h = q.strides()[1], p.q_l = q.strides()[2];
  p.k_b = k.strides()[0], p.k_h = k.strides()[1], p.k_l = k.strides()[2];
  p.v_b = v.strides()[0], p.v_h = v.strides()[1], p.v_l = v.strides()[2];
  p.dg = GradLayout::from_rows(p.L, p.S, p.D, static_cast<int64_t>(p.H) * p.D);
  p.scale = scale;
  p.causal = causal;
  return p;
}

// The tensor-core path needs 16-byte aligned rows: pointer and row/batch/head strides.
bool aligned16(const Tensor& t, int64_t s0, int64_t s1, int64_t s2, const char* op) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr(op));
  return addr % 16 == 0 && s0 % 8 == 0 && s1 % 8 == 0 && s2 % 8 == 0;
}

template <typename K>
void set_smem(K kernel, size_t bytes, const char* op) {
  if (bytes > 48 * 1024) {
    BT_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
  }
}

// Tensor cores: D in {64, 128}; grid (B * H, blocks) needs blocks <= 65535.
bool tc_shape(const AttnParams& p) {
  return (p.D == 64 || p.D == 128) && std::max(p.L, p.S) <= 65535 * 16;
}

void check_dims(const AttnParams& p, const char* op) {
  if (static_cast<int64_t>(p.B) * p.H * std::max(p.L, p.S) > (int64_t{1} << 36)) {
    throw NotImplementedError(std::string("[") + op + "] B * H * T too large");
  }
  if (p.D > 256) {
    throw NotImplementedError(std::string("[") + op + "] head dim " + std::to_string(p.D) +
                              " > 256 is not supported on CUDA");
  }
}

template <typename T, int D>
void launch_fwd_v2(const AttnParams& p, const T* q, const T* k, const T* v, T* o, float* lse,
                   cudaStream_t st, const char* op) {
  using C = V2Config<D>;
  constexpr int W = C::kFwdWarps, Bc = C::kFwdBc, MT = C::kFwdMT, Br = 16 * MT * W;
  constexpr size_t smem = fwd_smem<T, D, W, Bc, MT>();
  auto kern = attn_fwd_v2<T, D, W, Bc, MT, C::kFwdMinBlocks>;
  set_smem(kern, smem, op);
  dim3 grid(p.B * p.H, static_cast<unsigned>(ceil_div(p.L, Br)));
  kern<<<grid, W * 32, smem, st>>>(p, q, k, v, o, lse);
  BT_CUDA_LAUNCH_CHECK(op);
}

template <typename T, int D>
void launch_bwd_v2(const AttnParams& p, const T* q, const T* k, const T* v, const T* g,
                   const float* lse, const float* dvec, T* dq, T* dk, T* dv, cudaStream_t st,
                   const char* op) {
  using C = V2Config<D>;
  {
    constexpr int W = C::kKvWarps, Br = C::kKvBr, MT = C::kKvMT, Bc = 16 * MT * W;
    constexpr size_t smem = dkdv_smem<T, D, W, Br, MT>();
    auto kern = attn_bwd_dkdv_v2<T, D, W, Br, C::kKvFrag, C::kKvMinBlocks, MT>;
    set_smem(kern, smem, op);
    dim3 grid(p.B * p.H, static_cast<unsigned>(ceil_div(p.S, Bc)));
    kern<<<grid, W * 32, smem, st>>>(p, q, k, v, g, lse, dvec, dk, dv, nullptr);
    BT_CUDA_LAUNCH_CHECK(op);
  }
  {
    constexpr int W = C::kDqWarps, Bc = C::kDqBc, MT = C::kDqMT, Br = 16 * MT * W;
    constexpr size_t smem = dq_smem<T, D, W, Bc, MT>();
    auto kern = attn_bwd_dq_v2<T, D, W, Bc, C::kDqMinBlocks, MT>;
    set_smem(kern, smem, op);
    dim3 grid(p.B * p.H, static_cast<unsigned>(ceil_div(p.L, Br)));
    kern<<<grid, W * 32, smem, st>>>(p, q, k, v, g, lse, dvec, dq);
    BT_CUDA_LAUNCH_CHECK(op);
  }
}

// The one-kernel backward: dq_acc (B, H, L, D) float32 and one int after it (the Hopper kernel's
// bad-key flag), zeroed by the caller (launch_preprocess) on the stream.  On Hopper (sm_90a builds,
// D 64) attention_sm90.cu's wgmma kernel runs in place of attn_bwd_dkdv_v2<kDq>.  With p.cs (Note
// [packed column sums]) the conversion writes dq's column sums too.
template <typename T, int D>
void launch_bwd_fused(const AttnParams& p, const T* q, const T* k, const T* v, const T* g,
                      const float* lse, const float* dvec, float* dq_acc, T* dq, T* dk, T* dv,
                      cudaStream_t st, const char* op) {
  using C = V2Config<D>;
  const int64_t nacc = static_cast<int64_t>(p.B) * p.H * p.L * D;
  int* bad_keys = reinterpret_cast<int*>(dq_acc + nacc);  // (zeroed with dq_acc)
  const bool sm90 = attn_bwd_sm90<T>(p, q, k, v, g, lse, dvec, dq_acc, dk, dv, bad_keys, st, op);
  if (!sm90) {  // not Hopper: the mma.sync fused kernel
    constexpr int W = C::kFuWarps, Br = C::kFuBr, MT = C::kFuMT, Bc = 16 * MT * W;
    constexpr size_t smem = fused_smem<T, D, W, Br, MT>();
    auto kern = attn_bwd_dkdv_v2<T, D, W, Br, C::kFuFrag, C::kFuMinBlocks, MT, true, C::kFuGroupBh>;
    set_smem(kern, smem, op);
    dim3 grid(p.B * p.H, static_cast<unsigned>(ceil_div(p.S, Bc)));
    kern<<<grid, W * 32, smem, st>>>(p, q, k, v, g, lse, dvec, dk, dv, dq_acc);
    BT_CUDA_LAUNCH_CHECK(op);
  }
  // on Hopper, overlapping the backward's tail (Note [programmatic dependent launch])
  const DqFixInputs<T> fix{q, k, v, g, lse, dvec, dk, dv, sm90 ? bad_keys : nullptr};
  if constexpr (D == 64) {
    if (p.cs) {
      const int64_t threads = static_cast<int64_t>(p.B) * p.H * p.cs_groups * 32;
      launch_dependent(sm90, attn_bwd_dq_convert_cs<T>,
                       static_cast<unsigned>(ceil_div(threads, int64_t{256})), 256, 0, st, op, p,
                       static_cast<const float*>(dq_acc), dq, fix);
      return;
    }
  }
  launch_dependent(sm90, attn_bwd_dq_convert<T, D>,
                   static_cast<unsigned>(ceil_div(nacc / 8, int64_t{256})), 256, 0, st, op, p,
                   static_cast<const float*>(dq_acc), dq, fix);
}

unsigned v1_blocks(int64_t rows) { return static_cast<unsigned>(ceil_div(rows, kV1Warps)); }

// Dvec: the vectorised kernel when rows of o and do are 16-byte aligned, else v1.  acc_zero
// (optional): a (B, H, L, D) float32 buffer zeroed on the way (by the vectorised kernel, else by a
// memset).
// With p.cs (Note [packed column sums]; 16-bit, D 64, no dlse, rows 16-byte aligned)
// attn_bwd_preprocess_cs also writes the k and v partial column sums: returns whether it ran.
template <typename T, typename A>
bool launch_preprocess(const AttnParams& p, const T* o, const T* g, const A* dlse, A* dvec,
                       float* acc_zero, cudaStream_t st, const char* op, bool hopper = false) {
  constexpr int VW = 16 / sizeof(T);
  const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.L;
  const bool vec = p.D % VW == 0 && reinterpret_cast<uintptr_t>(o) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(g) % 16 == 0 && p.o_b % VW == 0 && p.o_l % VW == 0 &&
                   p.o_h % VW == 0 && p.g_b % VW == 0 && p.g_l % VW == 0 && p.g_h % VW == 0;
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    if (p.cs && vec && p.D == 64 && !dlse) {
      const int64_t threads = static_cast<int64_t>(p.B) * p.H * p.cs_groups * 32;
      launch_dependent(hopper, attn_bwd_preprocess_cs<T>,
                       static_cast<unsigned>(ceil_div(threads, int64_t{256})), 256, 0, st, op, p, o,
                       g, dvec, acc_zero);
      return true;
    }
  }
  if (!vec || (acc_zero && p.D % 4 != 0)) {
    attn_bwd_preprocess<T, A><<<v1_blocks(rows), kV1Warps * 32, 0, st>>>(p, o, g, dlse, dvec);
    BT_CUDA_LAUNCH_CHECK(op);
    if (acc_zero) {
      BT_CUDA_CHECK(op, cudaMemsetAsync(acc_zero, 0, (rows * p.D + 4) * sizeof(float), st));
    }
    return false;
  }
  const int chunks = p.D / VW;
  auto go = [&](auto lpr) {
    constexpr int L = decltype(lpr)::value;
    const auto blocks = static_cast<unsigned>(ceil_div(rows * L, int64_t{256}));
    launch_dependent(hopper, attn_bwd_preprocess_v2<T, A, L>, blocks, 256, 0, st, op, p, o, g, dlse,
                     dvec, acc_zero);
  };
  if (chunks <= 4) {
    go(std::integral_constant<int, 4>{});
  } else if (chunks <= 8) {
    go(std::integral_constant<int, 8>{});
  } else if (chunks <= 16) {
    go(std::integral_constant<int, 16>{});
  } else {
    go(std::integral_constant<int, 32>{});
  }
  return false;
}

}  // namespace

}  // namespace bt::cuda

namespace bt {

using namespace cuda;

// float32 on tensor cores (attention_tf32.cu): 1xTF32 for "high"/"medium", 3xTF32 (fp32-accurate)
// for "highest" or when the attention precision is "highest", 3xTF32 scores only when it is
// "scores" (autocast.h).  (The forward writes o (B, L, H, D) contiguous; dg is the backward's.)
static AttnTf32Args tf32_args(const AttnParams& p) {
  AttnTf32Args a{};
  a.B = p.B, a.H = p.H, a.L = p.L, a.S = p.S, a.D = p.D;
  a.q_b = p.q_b, a.q_h = p.q_h, a.q_l = p.q_l;
  a.k_b = p.k_b, a.k_h = p.k_h, a.k_l = p.k_l;
  a.v_b = p.v_b, a.v_h = p.v_h, a.v_l = p.v_l;
  a.g_b = p.g_b, a.g_l = p.g_l, a.g_h = p.g_h;
  a.dg = p.dg;
  a.scale = p.scale;
  a.causal = p.causal;
  // the matmul or the attention precision "highest": all; the attention precision "scores"
  a.prec = float32_attention_exact()          ? kTf32All
           : float32_attention_scores_exact() ? kTf32Scores
                                              : kTf32None;
  return a;
}
// The float32 backward's dQ by atomics (Note [tf32 dQ by atomics]) outside deterministic mode,
// where it measured faster (bench/attn_tf32_check.cu, B16 T1024 causal, C 768, ms split ->
// atomics): D 64 1xTF32 0.995 -> 0.805; D 128 1xTF32 1.494 -> 1.163; with 3xTF32's integer
// split (session 27) D 64 1.697 -> 1.492 and D 128 2.203 -> 1.609 (before it, D 128 spilled
// and the split was faster). BT_ATTN_TF32_FUSED=0 in the environment keeps the split everywhere
// (comparisons).
static bool tf32_fused_dq() {
  static const bool env_off = [] {
    const char* e = std::getenv("BT_ATTN_TF32_FUSED");
    return e && std::string(e) == "0";
  }();
  return !env_off && !deterministic_algorithms();
}
static bool ptr_aligned(const void* ptr, uintptr_t n) {
  return reinterpret_cast<uintptr_t>(ptr) % n == 0;
}

void FlashAttention::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const char* op = name();
  const Tensor &q = in[0], &k = in[1], &v = in[2];
  cudaStream_t st = stream(out[0].device(), op);
  if (out[0].numel() == 0) return;
  AttnParams p = make_params(q, k, v, scale, causal);
  check_dims(p, op);
  dispatch_cuda_float(q.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = math_t<T>;
    const T* qp = q.data<T>(op);
    const T* kp = k.data<T>(op);
    const T* vp = v.data<T>(op);
    T* o = out[0].data<T>(op);
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
      const bool tc = tc_shape(p) && aligned16(q, p.q_b, p.q_h, p.q_l, op) &&
                      aligned16(k, p.k_b, p.k_h, p.k_l, op) &&
                      aligned16(v, p.v_b, p.v_h, p.v_l, op);
      if (tc) {
        float* lse = out[1].data<float>(op);
        if (attn_fwd_sm90_supported(p)) {  // Hopper: wgmma (attention_sm90.cu)
          attn_fwd_sm90<T>(p, qp, kp, vp, o, lse, st, op);
        } else if (p.D == 64) {
          launch_fwd_v2<T, 64>(p, qp, kp, vp, o, lse, st, op);
        } else {
          launch_fwd_v2<T, 128>(p, qp, kp, vp, o, lse, st, op);
        }
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      const AttnTf32Args ta = tf32_args(p);
      if (attn_tf32_supported(ta) && ptr_aligned(qp, 16) && ptr_aligned(kp, 16) &&
          ptr_aligned(vp, 16)) {
        attn_fwd_tf32(ta, qp, kp, vp, o, out[1].data<float>(op), st, op);
        return;
      }
    }
    A* lse = out[1].data<A>(op);
    attn_fwd_v1<T, A><<<v1_blocks(static_cast<int64_t>(p.B) * p.H * p.L), kV1Warps * 32, 0, st>>>(
        p, qp, kp, vp, o, lse);
    BT_CUDA_LAUNCH_CHECK(op);
  });
}

// inputs q, k, v, o, do, lse, dlse; outputs dq (B, L, H, D), dk, dv (B, S, H, D).
namespace {
// FlashAttentionBackward's kernels; cs / cs_groups: Note [packed column sums] (null: none).
// Returns whether cs was written (the bf16 / fp16 one-kernel path, D 64, without dlse).
bool attention_backward_gpu(const FlashAttentionBackward& prim, const std::vector<Tensor>& in,
                            std::vector<Tensor>& out, float* cs, int cs_groups) {
  const char* op = prim.name();
  const double scale = prim.scale;
  const bool causal = prim.causal, heads_major = prim.heads_major;
  const Tensor &q = in[0], &k = in[1], &v = in[2], &o = in[3], &g = in[4], &lse = in[5],
               &dlse = in[6];
  cudaStream_t st = stream(out[0].device(), op);
  if (out[0].numel() == 0 && out[1].numel() == 0) return false;
  AttnParams p = make_params(q, k, v, scale, causal);
  check_dims(p, op);
  p.o_b = o.strides()[0], p.o_l = o.strides()[1], p.o_h = o.strides()[2];
  p.g_b = g.strides()[0], p.g_l = g.strides()[1], p.g_h = g.strides()[2];
  if (dlse.defined()) {  // undefined: no gradient reached lse (zero)
    p.dl_b = dlse.strides()[0], p.dl_h = dlse.strides()[1], p.dl_l = dlse.strides()[2];
  }
  if (!lse.is_contiguous()) {
    throw RuntimeError(std::string("[") + op + "] lse must be contiguous");
  }
  // dq, dk, dv seen as (B, L|S, H, D) views (attention_grad_rows): any strides with a unit D
  // stride; dk and dv share one layout (the kernels write both through p.dg.kv).
  const std::vector<Tensor> d = attention_grad_rows(out, heads_major);
  for (int i = 0; i < 3; ++i) {
    if (d[i].strides()[3] != 1 && p.D > 1) {
      throw RuntimeError(std::string("[") + op + "] unsupported gradient layout " +
                         shape_str(out[i].shape()) + " strides " + shape_str(out[i].strides()));
    }
  }
  auto bhl = [](const Tensor& t) {  // (b, h, l) strides of a (B, L, H, D) view
    const auto& w = t.strides();
    return std::array<int64_t, 3>{w[0], w[2], w[1]};
  };
  const auto sq = bhl(d[0]), sk = bhl(d[1]), sv = bhl(d[2]);
  if (sk != sv) {
    throw RuntimeError(std::string("[") + op + "] dk and dv must share a layout, got strides " +
                       shape_str(out[1].strides()) + " and " + shape_str(out[2].strides()));
  }
  p.dg = GradLayout{sq[0], sq[1], sq[2], sk[0], sk[1], sk[2]};
  bool cs_written = false;
  dispatch_cuda_float(q.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using A = math_t<T>;
    const T* qp = q.data<T>(op);
    const T* kp = k.data<T>(op);
    const T* vp = v.data<T>(op);
    const T* gp = g.data<T>(op);
    T* dq = out[0].data<T>(op);
    T* dk = out[1].data<T>(op);
    T* dv = out[2].data<T>(op);
    const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.L;
    Tensor dvec = empty_tensor({p.B, p.H, p.L}, lse.dtype(), out[0].device(), op);
    // The tensor-core paths (bf16 / fp16): aligned rows, an even gradient layout.  (g's batch
    // stride is a multiple of 8 whenever its row strides are, for dense layouts.)
    bool tc = false;
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
      tc = tc_shape(p) && aligned16(q, p.q_b, p.q_h, p.q_l, op) &&
           aligned16(k, p.k_b, p.k_h, p.k_l, op) && aligned16(v, p.v_b, p.v_h, p.v_l, op) &&
           aligned16(g, p.g_b, p.g_h, p.g_l, op) && p.dg.even() &&
           reinterpret_cast<uintptr_t>(dq) % 4 == 0 && reinterpret_cast<uintptr_t>(dk) % 4 == 0 &&
           reinterpret_cast<uintptr_t>(dv) % 4 == 0;
    }
    // fused, dQ by float atomics into dq_acc (D 64 only: for D 128 the split measured faster);
    // the preprocess zeroes dq_acc
    const bool fused = tc && !deterministic_algorithms() && p.D == 64;
    // (and 4 floats after it: the bad-key flag of launch_bwd_fused, zeroed with it)
    Tensor acc =
        fused ? empty_tensor({rows * p.D + 4}, DType::Float32, out[0].device(), op) : Tensor();
    // column sums (Note [packed column sums]) on the fused path: k and v's by the preprocess
    // (where it can), then q's by the dq conversion
    if (fused && cs) p.cs = cs, p.cs_groups = cs_groups;
    cs_written = launch_preprocess<T, A>(
        p, o.data<T>(op), gp, dlse.defined() ? dlse.data<A>(op) : nullptr, dvec.data<A>(op),
        fused ? acc.data<float>(op) : nullptr, st, op, fused && attn_fwd_sm90_supported(p));
    if (!cs_written) p.cs = nullptr;
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
      if (tc) {
        const float* lp = lse.data<float>(op);
        const float* dp = dvec.data<float>(op);
        if (fused) {
          launch_bwd_fused<T, 64>(p, qp, kp, vp, gp, lp, dp, acc.data<float>(op), dq, dk, dv, st,
                                  op);
          return;
        }
        if (p.D == 64) {
          launch_bwd_v2<T, 64>(p, qp, kp, vp, gp, lp, dp, dq, dk, dv, st, op);
        } else {
          launch_bwd_v2<T, 128>(p, qp, kp, vp, gp, lp, dp, dq, dk, dv, st, op);
        }
        return;
      }
    }
    if constexpr (std::is_same_v<T, float>) {
      AttnTf32Args ta = tf32_args(p);
      ta.fused_dq = tf32_fused_dq();
      if (attn_tf32_supported(ta) && ptr_aligned(qp, 16) && ptr_aligned(kp, 16) &&
          ptr_aligned(vp, 16) && ptr_aligned(gp, 16) && ptr_aligned(dq, 8) && ptr_aligned(dk, 8) &&
          ptr_aligned(dv, 8)) {
        attn_bwd_tf32(ta, qp, kp, vp, gp, lse.data<float>(op), dvec.data<float>(op), dq, dk, dv, st,
                      op);
        return;
      }
    }
    const A* lp = lse.data<A>(op);
    const A* dp = dvec.data<A>(op);
    attn_bwd_dq_v1<T, A><<<v1_blocks(rows), kV1Warps * 32, 0, st>>>(p, qp, kp, vp, gp, lp, dp, dq);
    BT_CUDA_LAUNCH_CHECK(op);
    attn_bwd_dkdv_v1<T, A>
        <<<v1_blocks(static_cast<int64_t>(p.B) * p.H * p.S), kV1Warps * 32, 0, st>>>(
            p, qp, kp, vp, gp, lp, dp, dk, dv);
    BT_CUDA_LAUNCH_CHECK(op);
  });
  return cs_written;
}
}  // namespace

void FlashAttentionBackward::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  attention_backward_gpu(*this, in, out, nullptr, 0);
}

// Packed: q, k, v are views of X; dq, dk, dv the three (B, T, H, D) slices of dX (row 3 H D).
void FlashAttentionPacked::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  FlashAttention(scale, causal).eval_gpu(packed_qkv_views(in[0], heads), out);
}

// The linear's GEMM into qkv, then the packed attention on it (as QkvAttention::eval_cpu).
void QkvAttention::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  std::vector<Tensor> proj{out[2]};
  Matmul(true, has_bias).eval_gpu(in, proj);
  const int64_t M = out[2].size(0), N = out[2].size(1);
  std::vector<Tensor> att{out[0], out[1]};
  FlashAttentionPacked(scale, causal, heads)
      .eval_gpu({make_view(out[2], {M / seq, seq, N}, {seq * N, N, 1}, out[2].offset())}, att);
}

// With colsum, out[1] = dX's column sums (Note [packed column sums]): partial sums of 16 rows from
// the preprocess and dq conversion kernels where they ran, added up by the column-sum kernels;
// else dX summed afterwards.
void FlashAttentionPackedBackward::eval_gpu(const std::vector<Tensor>& in,
                                            std::vector<Tensor>& out) {
  const char* op = name();
  auto qkv = packed_qkv_views(in[0], heads);
  auto douts = packed_grad_views(out[0], heads);
  const int64_t B = out[0].size(0), T = out[0].size(1), N = out[0].size(2);
  Tensor part;
  const int groups = static_cast<int>(ceil_div(T, int64_t{16}));
  if (colsum && B * T > 0 && N > 0) {
    part = empty_tensor({B * groups, N}, DType::Float32, out[0].device(), op);
  }
  const bool written = attention_backward_gpu(
      FlashAttentionBackward(scale, causal), {qkv[0], qkv[1], qkv[2], in[1], in[2], in[3], in[4]},
      douts, part.defined() ? part.data<float>(op) : nullptr, groups);
  if (!colsum) return;
  if (written) {
    cuda::column_sums_any(part, out[1], op);
  } else {
    const Tensor rows = make_view(out[0], {B * T, N}, {N, 1}, out[0].offset());
    cuda::column_sums_any(rows, out[1], op);
  }
}

}  // namespace bt
#else
}  // namespace bt::cuda
#endif  // BT_ATTENTION_KERNELS_ONLY
