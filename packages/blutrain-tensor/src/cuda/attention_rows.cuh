// cuda/attention_rows.cuh: one attention row by one warp, the CPU reference's arithmetic
// (cpu/attention.cpp) in float (double for float64): what the tensor-core kernels fall back to for
// a row whose result is not finite.  Include only from .cu files (after common.cuh).
//
// Note [non-finite rows]
// The tensor-core kernels (mma.sync, wgmma, TF32) multiply whole tiles: in the causal diagonal
// tile a masked key's weight 0 meets its value row (0 * inf = NaN), and in the backward a masked
// pair's 0 meets q, k, v or do; a row of -inf scores (Note [empty rows], attention.h) gives 0 * k
// and 0 * v products too.  The CPU and the SIMT kernels loop over visible keys only (Note [causal
// masks skip]).  Rather than test every tile, each kernel checks the values it is about to store
// (in registers): a row (of o, dq, or a key's dk / dv) with a non-finite value is recomputed here
// by its warp, looping over visible pairs only, which gives the CPU's answer whether the value
// was poisoned or is truly inf / NaN.  Zero cost while results are finite (a compare per stored
// value and one ballot per row slot); a row that is truly NaN (a diverged run) costs one SIMT row
// of work.  Lanes hold d = lane + 32 u (u < 8): D <= 256.
//
// Note [no calls in wgmma kernels]
// The Hopper wgmma kernels (attention_sm90.cu) must not recompute in place: a call, or the row's
// code inlined, in their persistent loop makes ptxas serialise the wgmmas ("C7520: wgmma.mma_async
// instructions are serialized due to ... WG.AR in divergent path"), which cost GPT-2's bf16 step
// 1.5 ms (forward +20%, backward +28%, session 50's profile).  They only mark: the forward writes
// a bad row's lse as kBadRowLse and attn_fix_marked_rows recomputes those rows after it; the
// backward sets a flag word that the dq conversion reads, which then checks and recomputes the
// key rows.  ptxas must print no C7520 for attn_fwd_sm90_ws / attn_bwd_sm90_ws.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace bt::cuda {

template <typename A, typename T>
__device__ __forceinline__ A rows_to(T v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return static_cast<A>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<T, __half>) {
    return static_cast<A>(__half2float(v));
  } else {
    return static_cast<A>(v);
  }
}
template <typename T, typename A>
__device__ __forceinline__ T rows_from(A v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

template <typename A>
__device__ __forceinline__ A rows_exp(A x) {
  if constexpr (sizeof(A) == 8) {
    return exp(x);
  } else {
    return expf(x);
  }
}

template <typename A, typename T>
__device__ __forceinline__ void rows_load(A (&r)[8], const T* p, int D) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int d = lane + 32 * u;
    r[u] = d < D ? rows_to<A>(p[d]) : A(0);
  }
}

template <typename A>
__device__ __forceinline__ A rows_dot(const A (&x)[8], const A (&y)[8]) {
  A s = 0;
#pragma unroll
  for (int u = 0; u < 8; ++u) s += x[u] * y[u];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// A forward row to recompute: its lse as stored by a wgmma kernel (a quiet NaN whose payload no
// arithmetic makes: the GPU's NaNs are 0x7fffffff).
constexpr uint32_t kBadRowLse = 0x7fcbad00u;

// Where the rows live: element strides of q (B, H, L, D), k and v (B, H, S, D) rows, do
// (B, L, H, D) rows; the (b, h) pair's bases are passed in.
struct RowsArgs {
  int L, S, D;
  int64_t q_l, k_l, v_l, g_l;
  double scale;
  bool causal;
};

// Forward row i of one (b, h): o_row (D elements), *lse_out (lane 0 writes).  Two passes (max,
// then exp sums), as the CPU: a NaN score makes the row NaN, +inf too (exp(inf - inf)); a row of
// -inf scores is o = 0, lse = -inf (Note [empty rows]).
template <typename T, typename A, typename LS>
__device__ void attn_row_fwd(const RowsArgs& a, const T* qb, const T* kb, const T* vb, int i,
                             T* o_row, LS* lse_out) {
  A qv[8], kv[8], vv[8], acc[8];
  rows_load(qv, qb + i * a.q_l, a.D);
  const A sc = static_cast<A>(a.scale);
  const int n = a.causal ? min(i + 1, a.S) : a.S;
  A m = -INFINITY;
  bool nan = false;
  for (int j = 0; j < n; ++j) {
    rows_load(kv, kb + j * a.k_l, a.D);
    const A s = rows_dot(qv, kv) * sc;
    nan = nan || s != s;
    m = fmax(m, s);  // (ignores NaN, as std::max on the CPU)
  }
  const int lane = threadIdx.x % 32;
  if (m == -INFINITY && !nan) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (lane + 32 * u < a.D) o_row[lane + 32 * u] = rows_from<T>(A(0));
    }
    if (lane == 0) *lse_out = static_cast<LS>(-INFINITY);
    return;
  }
  A l = 0;
#pragma unroll
  for (int u = 0; u < 8; ++u) acc[u] = 0;
  for (int j = 0; j < n; ++j) {
    rows_load(kv, kb + j * a.k_l, a.D);
    rows_load(vv, vb + j * a.v_l, a.D);
    const A p = rows_exp(rows_dot(qv, kv) * sc - m);
    l += p;
#pragma unroll
    for (int u = 0; u < 8; ++u) acc[u] += p * vv[u];
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    if (lane + 32 * u < a.D) o_row[lane + 32 * u] = rows_from<T>(acc[u] / l);
  }
  if (lane == 0) *lse_out = static_cast<LS>(m + log(l));
}

// dq row i (unscaled by nothing: the result is final, scale applied): sum over visible j of
// p_ij (dp_ij - Dvec_i) k_j * scale, p_ij = exp(s_ij scale - lse_i); no term for a row whose lse
// is -inf (an empty row passes no gradient).  Returns the D values in lanes (out[u], d = lane +
// 32 u) for the caller's layout.
template <typename T, typename A>
__device__ void attn_row_dq(const RowsArgs& a, const T* qb, const T* kb, const T* vb,
                            const T* g_row, A lse_i, A dvec_i, int i, A (&out)[8]) {
  A qv[8], gv[8], kv[8], vv[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) out[u] = 0;
  if (lse_i == -INFINITY) return;
  rows_load(qv, qb + i * a.q_l, a.D);
  rows_load(gv, g_row, a.D);
  const A sc = static_cast<A>(a.scale);
  const int n = a.causal ? min(i + 1, a.S) : a.S;
  for (int j = 0; j < n; ++j) {
    rows_load(kv, kb + j * a.k_l, a.D);
    rows_load(vv, vb + j * a.v_l, a.D);
    const A p = rows_exp(rows_dot(qv, kv) * sc - lse_i);
    const A ds = p * (rows_dot(gv, vv) - dvec_i);
#pragma unroll
    for (int u = 0; u < 8; ++u) out[u] += ds * kv[u];
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) out[u] *= sc;
}

// dk, dv of key row j: sums over the queries that see it (i >= j when causal), rows whose lse is
// -inf skipped.  gb: do's (b, h) base with row stride a.g_l; lse_b, dvec_b: the pair's (L) rows.
template <typename T, typename A, typename LS>
__device__ void attn_row_dkdv(const RowsArgs& a, const T* qb, const T* kb, const T* vb, const T* gb,
                              const LS* lse_b, const LS* dvec_b, int j, A (&dk)[8], A (&dv)[8]) {
  A qv[8], gv[8], kv[8], vv[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) dk[u] = dv[u] = 0;
  rows_load(kv, kb + j * a.k_l, a.D);
  rows_load(vv, vb + j * a.v_l, a.D);
  const A sc = static_cast<A>(a.scale);
  for (int i = a.causal ? j : 0; i < a.L; ++i) {
    const A li = static_cast<A>(lse_b[i]);
    if (li == -INFINITY) continue;
    rows_load(qv, qb + i * a.q_l, a.D);
    rows_load(gv, gb + i * a.g_l, a.D);
    const A p = rows_exp(rows_dot(qv, kv) * sc - li);
    const A ds = p * (rows_dot(gv, vv) - static_cast<A>(dvec_b[i]));
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      dk[u] += ds * qv[u];
      dv[u] += p * gv[u];
    }
  }
#pragma unroll
  for (int u = 0; u < 8; ++u) dk[u] *= sc;
}

// The fallbacks the kernels call for a bad row (out of line: the kernels' register allocation
// is not the rows' business).  o / lse of query row i; dq of query row i; dk, dv of key row j.
// Row pointers are where the kernel stores that row (D contiguous elements).
template <typename T>
__device__ __noinline__ void fix_o_row(const RowsArgs& a, const T* qb, const T* kb, const T* vb,
                                       int i, T* o_row, float* lse_out) {
  attn_row_fwd<T, float, float>(a, qb, kb, vb, i, o_row, lse_out);
}
template <typename T>
__device__ __noinline__ void fix_dq_row(const RowsArgs& a, const T* qb, const T* kb, const T* vb,
                                        const T* gb, const float* lse_b, const float* dvec_b, int i,
                                        T* dq_row) {
  float out[8];
  attn_row_dq<T, float>(a, qb, kb, vb, gb + i * a.g_l, lse_b[i], dvec_b[i], i, out);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    if (lane + 32 * u < a.D) dq_row[lane + 32 * u] = rows_from<T>(out[u]);
  }
}
template <typename T>
__device__ __noinline__ void fix_dkdv_row(const RowsArgs& a, const T* qb, const T* kb, const T* vb,
                                          const T* gb, const float* lse_b, const float* dvec_b,
                                          int j, T* dk_row, T* dv_row) {
  float dk[8], dv[8];
  attn_row_dkdv<T, float, float>(a, qb, kb, vb, gb, lse_b, dvec_b, j, dk, dv);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    if (lane + 32 * u < a.D) {
      dk_row[lane + 32 * u] = rows_from<T>(dk[u]);
      dv_row[lane + 32 * u] = rows_from<T>(dv[u]);
    }
  }
}

// 16-bit pairs (bf16 / fp16) or floats that are not finite.
template <typename T>
__device__ __forceinline__ bool pair_nonfinite(uint32_t v) {
  constexpr uint32_t e = std::is_same_v<T, __nv_bfloat16> ? 0x7f80u : 0x7c00u;
  return (v & e) == e || ((v >> 16) & e) == e;
}

// The warp's rows flagged bad (one flag per lane, kLanes lanes per row g = lane / kLanes: a quad
// for the mma layouts, 32 / kLanes rows per ballot): fn(g) for each bad row, by the whole warp,
// after its own stores (any lane of a row's group may raise the flag).  All 32 lanes call it.
template <int kLanes = 4, typename F>
__device__ __forceinline__ void for_bad_rows(bool bad, F&& fn) {
  unsigned m = __ballot_sync(0xffffffffu, bad);
  if (m == 0) return;
  __syncwarp();  // the original stores of those rows land first
  constexpr unsigned kGroup = kLanes == 32 ? 0xffffffffu : (1u << kLanes) - 1;
  while (m) {
    const int g = (__ffs(m) - 1) / kLanes;
    m &= ~(kGroup << (kLanes * g));
    fn(g);
  }
  __syncwarp();
}

}  // namespace bt::cuda
