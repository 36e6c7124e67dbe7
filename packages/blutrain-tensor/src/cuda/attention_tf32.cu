// cuda/attention_tf32.cu: flash attention (FA2 style) for float32 inputs on tensor cores.
//
// Kernels (templated on kPrec, Note [scores in 3xTF32]), D in {64, 128}:
//   attn_fwd_tf32_k        online softmax (log2 domain), no L x S matrix in memory
//   attn_bwd_dkdv_tf32_k   dK, dV per key block looping over query blocks (recompute P from lse)
//   attn_bwd_dq_tf32_k     dQ per query block looping over key blocks
// That split is deterministic (no atomics), like attention.cu's v2 kernels.  Outside
// deterministic mode (AttnTf32Args::fused_dq) the dK / dV kernel also adds each tile's dQ part
// (dS K over its keys) into the zeroed dq with float atomics, and the dQ kernel (which recomputes
// S and dP) is not run: see Note [tf32 dQ by atomics].
//
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 fragments (PTX ISA, "Matrix fragments for
// mma.m16n8k8" .tf32), g = lane / 4, t = lane % 4, one 32-bit element per register:
//   A (16 x 8 row major): a0 = A[g][t]  a1 = A[g+8][t]  a2 = A[g][t+4]  a3 = A[g+8][t+4]
//   B (8 x 8 "col"):      b0 = B[t][g]  b1 = B[t+4][g]
//   C (16 x 8 f32):       c0, c1 = C[g][2t], C[g][2t+1]    c2, c3 = C[g+8][2t], C[g+8][2t+1]
// P (a C tile) is reused as the A operand of P V with the k index permuted consistently:
// logical k = t is key 2t, k = t + 4 is key 2t + 1, so a = {c0, c2, c1, c3} and the B operand
// loads V rows 2t (b0) and 2t + 1 (b1).  A k permutation of both operands leaves A B unchanged.
//
// Shared memory tiles are float rows of D + 4 elements: the 4-float pad puts the 32 lanes of
// every fragment load (X[g][t], and X[2t][g] for the permuted k-major B) in 32 different banks.
// Fragments are read with scalar LDS and rounded to TF32 (1xTF32: cvt.rna; 3xTF32: integer
// rounding, see split()); 3xTF32 also keeps the residual small = x - big and accumulates
// big*small + small*big + big*big (small terms first), dropping small*small (~2^-22 relative),
// as CUTLASS's OpMultiplyAddFastF32 does.
//
// Note [scores in 3xTF32]: kPrec 0 runs every product in 1xTF32, 2 every product in 3xTF32, and
// 1 only the scores S = Q K^T (the forward's, and the backward's recomputed S) in 3xTF32, the
// other products (P V, dO V^T, P^T dO, dS^T Q, dS K) in 1xTF32.  Why the scores: softmax turns
// an absolute error in a score into the same relative error in its probability, and TF32's
// relative 2^-11 on a score of size |q| |k| is an absolute error that grows with the scores as
// training sharpens them; the other products' errors stay relative, as any TF32 GEMM's.
// Measured (session 56, GPT-2 124M, 8 seeds, at fp32 weights after 60 steps): 1xTF32 attention
// puts the model's gradient error against fp32 at 6.29e-4, 3xTF32 at 4.82e-4 (PyTorch's tf32:
// 4.79e-4, its float32 SDPA being 3xTF32).
#include <algorithm>
#include <string>
#include <type_traits>  // integral_constant: kPrec from the arguments

#include "attention_rows.cuh"
#include "attention_tf32.cuh"

#ifdef BT_ATTN_TF32_STANDALONE  // bench/attn_tf32_check.cu compiles this file alone
#include <cstdio>
#include <stdexcept>
#define BT_CUDA_CHECK(op, expr)                                                \
  do {                                                                         \
    const cudaError_t e_ = (expr);                                             \
    if (e_ != cudaSuccess)                                                     \
      throw std::runtime_error(std::string("[") + (op) + "] " + #expr + ": " + \
                               cudaGetErrorString(e_));                        \
  } while (0)
#define BT_CUDA_LAUNCH_CHECK(op) BT_CUDA_CHECK((op), cudaGetLastError())
#else
#include "runtime.h"
#endif

namespace bt::cuda {

namespace {

constexpr float kLog2eF = 1.4426950408889634f;
constexpr float kLn2F = 0.6931471805599453f;

// ==== kernels ==================================================================================

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
// 16-byte async copy; pred false zero-fills the destination (src is then not read).
__device__ __forceinline__ void cpa16(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cpa4(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cpa_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cpa_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ float ex2(float x) {  // 2^x (MUFU), 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t tf32_rna(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// out[0] += x, out[1] += y by atomics: one vector atomic where the GPU has it (sm_90).
__device__ __forceinline__ void add_pair(float* out, float x, float y) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(out), make_float2(x, y));
#else
  atomicAdd(out, x);
  atomicAdd(out + 1, y);
#endif
}

// Fragments: hi = tf32(x); lo = tf32(x - hi) only when kExact.
template <bool kExact>
struct FragA {
  uint32_t hi[4];
  uint32_t lo[kExact ? 4 : 1];
};
template <bool kExact>
struct FragB {
  uint32_t hi[2];
  uint32_t lo[kExact ? 2 : 1];
};
// 3xTF32 rounds hi with two integer ops ((bits + 0x1000) & ~0x1fff: half away from zero) and
// passes lo = x - hi (exact) as is, the MMA reading its top 10 mantissa bits: no cvt, as
// blutrain-linalg's 3xTF32 GEMM (Note [3xTF32] there; 5-8% faster than two cvt.rna). An infinite
// x gives lo = NaN either way; a NaN stays NaN in lo.
template <bool kExact>
__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t* lo) {
  if constexpr (kExact) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    *lo = __float_as_uint(x - __uint_as_float(hi));
  } else {
    hi = tf32_rna(x);
  }
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool kExact>
__device__ __forceinline__ void mma(float (&c)[4], const FragA<kExact>& a, const FragB<kExact>& b) {
  if constexpr (kExact) {
    mma_tf32(c, a.hi, b.lo[0], b.lo[1]);
    mma_tf32(c, a.lo, b.hi[0], b.hi[1]);
  }
  mma_tf32(c, a.hi, b.hi[0], b.hi[1]);
}

// A (16 x 8) = X[r0 .. r0 + 15][k0 .. k0 + 7] of a row-major tile with row stride LD.
template <bool kExact, int LD>
__device__ __forceinline__ FragA<kExact> lda(const float* X, int r0, int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* p = X + (r0 + g) * LD + k0 + t;
  FragA<kExact> a;
  split<kExact>(p[0], a.hi[0], a.lo);
  split<kExact>(p[8 * LD], a.hi[1], a.lo + (kExact ? 1 : 0));
  split<kExact>(p[4], a.hi[2], a.lo + (kExact ? 2 : 0));
  split<kExact>(p[8 * LD + 4], a.hi[3], a.lo + (kExact ? 3 : 0));
  return a;
}
// B[k][n] = Y[n0 + n][k0 + k] of a tile stored n-major (K for S = Q K^T).
template <bool kExact, int LD>
__device__ __forceinline__ FragB<kExact> ldb_n(const float* Y, int n0, int k0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* p = Y + (n0 + g) * LD + k0 + t;
  FragB<kExact> b;
  split<kExact>(p[0], b.hi[0], b.lo);
  split<kExact>(p[4], b.hi[1], b.lo + (kExact ? 1 : 0));
  return b;
}
// B[k][n] = Y[k0 + k'][n0 + n] of a tile stored k-major (V for O = P V), k permuted: logical k
// = t is row 2t, k = t + 4 is row 2t + 1 (matches a_from_c).
template <bool kExact, int LD>
__device__ __forceinline__ FragB<kExact> ldb_k(const float* Y, int k0, int n0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* p = Y + (k0 + 2 * t) * LD + n0 + g;
  FragB<kExact> b;
  split<kExact>(p[0], b.hi[0], b.lo);
  split<kExact>(p[LD], b.hi[1], b.lo + (kExact ? 1 : 0));
  return b;
}
// A (16 x 8) = X[k0 + k'][r0 .. r0 + 15] of a tile stored k-major (dS^T, keys as rows, for
// dQ = dS K), k permuted as ldb_k's: logical k = t is row 2t, k = t + 4 is row 2t + 1.  With a
// row stride of 4 mod 32 floats the 32 lanes hit 32 banks.
template <bool kExact, int LD>
__device__ __forceinline__ FragA<kExact> lda_k(const float* X, int k0, int r0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* p = X + (k0 + 2 * t) * LD + r0 + g;
  FragA<kExact> a;
  split<kExact>(p[0], a.hi[0], a.lo);
  split<kExact>(p[8], a.hi[1], a.lo + (kExact ? 1 : 0));
  split<kExact>(p[LD], a.hi[2], a.lo + (kExact ? 2 : 0));
  split<kExact>(p[LD + 8], a.hi[3], a.lo + (kExact ? 3 : 0));
  return a;
}
// A from a C tile (its 8 columns become the permuted k): a0 = c0, a1 = c2, a2 = c1, a3 = c3.
template <bool kExact>
__device__ __forceinline__ FragA<kExact> a_from_c(const float (&c)[4]) {
  FragA<kExact> a;
  split<kExact>(c[0], a.hi[0], a.lo + 0);
  split<kExact>(c[2], a.hi[1], a.lo + (kExact ? 1 : 0));
  split<kExact>(c[1], a.hi[2], a.lo + (kExact ? 2 : 0));
  split<kExact>(c[3], a.hi[3], a.lo + (kExact ? 3 : 0));
  return a;
}

// Async copy of rows [row0, row0 + R) of a (rows, D) float matrix with row stride `ld` into a
// tile of row stride D + 4; rows >= nrows are zero-filled.  Called by all NT threads.
template <int R, int D, int NT>
__device__ __forceinline__ void load_rows(float* tile, const float* src, int64_t ld, int row0,
                                          int nrows) {
  constexpr int C = D / 4, LD = D + 4;
#pragma unroll
  for (int idx = threadIdx.x; idx < R * C; idx += NT) {
    const int r = idx / C, c = idx % C;
    const bool ok = row0 + r < nrows;
    const float* s = ok ? src + (row0 + r) * ld + c * 4 : src;
    cpa16(smem_addr(tile + r * LD + c * 4), s, ok);
  }
}
template <int R, int NT>
__device__ __forceinline__ void load_floats(float* dst, const float* src, int row0, int nrows) {
  for (int r = threadIdx.x; r < R; r += NT) {
    const bool ok = row0 + r < nrows;
    cpa4(smem_addr(dst + r), ok ? src + row0 + r : src, ok);
  }
}

// Forward.  kWarps warps, each owning kMT m-tiles of 16 query rows (kBr = 16 kMT kWarps rows per
// block), key tiles of kBc (double-buffered K, V).  kQReg keeps the warp's Q fragments in
// registers (else they are re-read from shared memory per key tile).  Grid (B * H, L / kBr),
// the last (heaviest, when causal) query blocks first.
template <int D, int kPrec, int kWarps, int kBc, int kMT, bool kQReg>
__global__ void __launch_bounds__(kWarps * 32)
    attn_fwd_tf32_k(AttnTf32Args p, const float* __restrict__ q, const float* __restrict__ k,
                    const float* __restrict__ v, float* __restrict__ o, float* __restrict__ lse) {
  constexpr bool kS = kPrec >= 1, kR = kPrec == 2;  // Note [scores in 3xTF32]
  constexpr int kWr = 16 * kMT, kBr = kWr * kWarps, NT = kWarps * 32, LD = D + 4, KC = D / 8;
  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);  // kBr x LD
  float* sK = sQ + kBr * LD;                      // 2 x kBc x LD
  float* sV = sK + 2 * kBc * LD;                  // 2 x kBc x LD
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBr;
  const float* qb = q + b * p.q_b + h * p.q_h;
  const float* kb = k + b * p.k_b + h * p.k_h;
  const float* vb = v + b * p.v_b + h * p.v_h;
  const int kend = p.causal ? min(q0 + kBr, p.S) : p.S;
  const int nkb = (kend + kBc - 1) / kBc;

  load_rows<kBr, D, NT>(sQ, qb, p.q_l, q0, p.L);
  cpa_commit();
  load_rows<kBc, D, NT>(sK, kb, p.k_l, 0, p.S);
  load_rows<kBc, D, NT>(sV, vb, p.v_l, 0, p.S);
  cpa_commit();
  cpa_wait<1>();  // Q landed
  __syncthreads();
  const int wrow = warp * kWr;
  FragA<kS> qf[kQReg ? kMT : 1][kQReg ? KC : 1];
  if constexpr (kQReg) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int kc = 0; kc < KC; ++kc) qf[mt][kc] = lda<kS, LD>(sQ, wrow + 16 * mt, 8 * kc);
    }
  }
  float oacc[kMT][D / 8][4];
  float m[kMT][2], l[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      oacc[mt][i][0] = oacc[mt][i][1] = oacc[mt][i][2] = oacc[mt][i][3] = 0.f;
    m[mt][0] = m[mt][1] = -INFINITY;
    l[mt][0] = l[mt][1] = 0.f;
  }
  const float sl2 = static_cast<float>(p.scale) * kLog2eF;
  const int row_lo = q0 + wrow + g;  // rows of (mt, r): row_lo + 16 mt + 8 r

  for (int j = 0; j < nkb; ++j) {
    if (j + 1 < nkb) {
      const int nb = (j + 1) & 1;
      load_rows<kBc, D, NT>(sK + nb * kBc * LD, kb, p.k_l, (j + 1) * kBc, p.S);
      load_rows<kBc, D, NT>(sV + nb * kBc * LD, vb, p.v_l, (j + 1) * kBc, p.S);
    }
    cpa_commit();
    cpa_wait<1>();  // tile j landed
    __syncthreads();
    const float* cK = sK + (j & 1) * kBc * LD;
    const float* cV = sV + (j & 1) * kBc * LD;

    // S = Q K^T
    float s[kMT][kBc / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int i = 0; i < kBc / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      FragA<kS> qa[kQReg ? 1 : kMT];
      if constexpr (!kQReg) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) qa[mt] = lda<kS, LD>(sQ, wrow + 16 * mt, 8 * kc);
      }
#pragma unroll
      for (int nt = 0; nt < kBc / 8; ++nt) {
        const FragB<kS> kf = ldb_n<kS, LD>(cK, 8 * nt, 8 * kc);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          if constexpr (kQReg) {
            mma<kS>(s[mt][nt], qf[mt][kc], kf);
          } else {
            mma<kS>(s[mt][nt], qa[mt], kf);
          }
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
        const float alpha = ex2(m[mt][r] - base);
        m[mt][r] = mx;
        float rs = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBc / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = ex2(fmaf(s[mt][nt][2 * r + e], sl2, -base));
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
    // O += P V (the key tile's n-tiles of S are the k-chunks)
#pragma unroll
    for (int kc = 0; kc < kBc / 8; ++kc) {
      FragA<kR> pa[kMT];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) pa[mt] = a_from_c<kR>(s[mt][kc]);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const FragB<kR> vf = ldb_k<kR, LD>(cV, 8 * kc, 8 * dt);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) mma<kR>(oacc[mt][dt], pa[mt], vf);
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
        float* orow = o + ((static_cast<int64_t>(b) * p.L + row) * p.H + h) * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          const float2 w = make_float2(oacc[mt][dt][2 * r] * inv, oacc[mt][dt][2 * r + 1] * inv);
          bad |= !isfinite(w.x) || !isfinite(w.y);
          *reinterpret_cast<float2*>(orow + dt * 8 + 2 * t) = w;
        }
        if (t == 0) lse[static_cast<int64_t>(bh) * p.L + row] = (m[mt][r] + log2f(lr)) * kLn2F;
      }
      for_bad_rows(bad, [&](int gb) {  // Note [non-finite rows] (attention_rows.cuh)
        const int rb = row - g + gb;
        const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
        attn_row_fwd<float, float, float>(ra, qb, kb, vb, rb,
                                          o + ((static_cast<int64_t>(b) * p.L + rb) * p.H + h) * D,
                                          lse + static_cast<int64_t>(bh) * p.L + rb);
      });
    }
  }
}

// Backward, dK and dV.  kWarps warps own kBc = 16 kWarps keys (16 per warp, keys as M) and loop
// over query tiles of kBr rows (double-buffered Q, dO, lse, Dvec).  Per tile, per warp:
//   S^T = K Q^T, dP^T = V dO^T, P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - Dvec),
//   dV += P^T dO, dK += dS^T Q (times scale at the end).
// kDq: also dq += scale dS K over the block's keys, by float atomics (dq zeroed before).
//
// Note [tf32 dQ by atomics]: the tile's dO buffer is free once dV has its product, so the warps
// write dS^T there (kBc rows of kBr + 4 floats: fits in kBr rows of D + 4 whenever kBc <= kBr
// (D + 4) / (kBr + 4)), then each warp takes one 16-query m-tile and 8 of the D / 8 n-tiles of
// dS K, with all kBc keys as k, and adds its 16 x 64 part to dq.  Summing across warps first
// keeps the atomics at one per dq element per (key block, query tile), as FlashAttention-2's.
// The dQ kernel's second pass over S and dP (a third of the backward's MMAs) is gone; the order
// of the float additions into dq varies, hence not in deterministic mode.
template <int D, int kPrec, int kWarps, int kBr, bool kDq = false>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_dkdv_tf32_k(AttnTf32Args p, const float* __restrict__ q, const float* __restrict__ k,
                         const float* __restrict__ v, const float* __restrict__ gr,
                         const float* __restrict__ lse, const float* __restrict__ dvec,
                         float* __restrict__ dk, float* __restrict__ dv, float* __restrict__ dq) {
  constexpr bool kS = kPrec >= 1, kR = kPrec == 2;  // Note [scores in 3xTF32]
  constexpr int kBc = 16 * kWarps, NT = kWarps * 32, LD = D + 4, KC = D / 8;
  constexpr int LDS = kBr + 4;                           // dS^T rows in the dO buffer (kDq)
  constexpr int kMTiles = kBr / 16;                      // dQ m-tiles of a query tile
  constexpr int kNPerWarp = (D / 8) * kMTiles / kWarps;  // dQ n-tiles per warp
  static_assert(!kDq || (kBc * LDS <= kBr * LD && kWarps % kMTiles == 0 && kNPerWarp >= 1),
                "dS^T must fit in a dO buffer, and the dQ tiles split evenly over the warps");
  extern __shared__ float4 smem_f4[];
  float* sK = reinterpret_cast<float*>(smem_f4);  // kBc x LD
  float* sV = sK + kBc * LD;                      // kBc x LD
  float* sQ = sV + kBc * LD;                      // 2 x kBr x LD
  float* sG = sQ + 2 * kBr * LD;                  // 2 x kBr x LD
  float* sL = sG + 2 * kBr * LD;                  // 2 x kBr
  float* sD = sL + 2 * kBr;                       // 2 x kBr
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int k0 = blockIdx.y * kBc;
  const float* qb = q + b * p.q_b + h * p.q_h;
  const float* kb = k + b * p.k_b + h * p.k_h;
  const float* vb = v + b * p.v_b + h * p.v_h;
  const float* gb = gr + b * p.g_b + h * p.g_h;  // dO rows: stride g_l
  const float* lb = lse + static_cast<int64_t>(bh) * p.L;
  const float* db = dvec + static_cast<int64_t>(bh) * p.L;
  const int i_begin = p.causal ? k0 / kBr : 0;
  const int i_end = (p.L + kBr - 1) / kBr;

  load_rows<kBc, D, NT>(sK, kb, p.k_l, k0, p.S);
  load_rows<kBc, D, NT>(sV, vb, p.v_l, k0, p.S);
  cpa_commit();
  auto load_q = [&](int i, int buf) {
    load_rows<kBr, D, NT>(sQ + buf * kBr * LD, qb, p.q_l, i * kBr, p.L);
    load_rows<kBr, D, NT>(sG + buf * kBr * LD, gb, p.g_l, i * kBr, p.L);
    load_floats<kBr, NT>(sL + buf * kBr, lb, i * kBr, p.L);
    load_floats<kBr, NT>(sD + buf * kBr, db, i * kBr, p.L);
  };
  if (i_begin < i_end) load_q(i_begin, 0);
  cpa_commit();

  float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[i][e] = dva[i][e] = 0.f;
  }
  const float sl2 = static_cast<float>(p.scale) * kLog2eF;
  const int key_lo = k0 + warp * 16 + g;  // keys of rows r: key_lo + 8 r

  for (int i = i_begin; i < i_end; ++i) {
    const int buf = (i - i_begin) & 1;
    if (i + 1 < i_end) load_q(i + 1, buf ^ 1);
    cpa_commit();
    cpa_wait<1>();  // tile i (and K, V) landed
    __syncthreads();
    const float* cQ = sQ + buf * kBr * LD;
    const float* cG = sG + buf * kBr * LD;
    const float* cL = sL + buf * kBr;
    const float* cD = sD + buf * kBr;

    float st[kBr / 8][4], dpt[kBr / 8][4];
#pragma unroll
    for (int n = 0; n < kBr / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const FragA<kS> ka = lda<kS, LD>(sK, warp * 16, 8 * kc);
      const FragA<kR> va = lda<kR, LD>(sV, warp * 16, 8 * kc);
#pragma unroll
      for (int nt = 0; nt < kBr / 8; ++nt) {
        mma<kS>(st[nt], ka, ldb_n<kS, LD>(cQ, 8 * nt, 8 * kc));
        mma<kR>(dpt[nt], va, ldb_n<kR, LD>(cG, 8 * nt, 8 * kc));
      }
    }
    const int q0 = i * kBr;
    const bool need_mask = q0 + kBr > p.L || (p.causal && q0 < k0 + warp * 16 + 15);
#pragma unroll
    for (int nt = 0; nt < kBr / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int cl = nt * 8 + 2 * t + (e & 1);  // query within the tile
        float pv = ex2(fmaf(st[nt][e], sl2, -cL[cl] * kLog2eF));
        if (need_mask) {
          const int query = q0 + cl, key = key_lo + 8 * (e >> 1);
          if (query >= p.L || (p.causal && key > query)) pv = 0.f;
        }
        st[nt][e] = pv;
        dpt[nt][e] = pv * (dpt[nt][e] - cD[cl]);
      }
    }
    // dV += P^T dO, dK += dS^T Q (queries as k)
#pragma unroll
    for (int kc = 0; kc < kBr / 8; ++kc) {
      const FragA<kR> pa = a_from_c<kR>(st[kc]);
      const FragA<kR> da = a_from_c<kR>(dpt[kc]);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        mma<kR>(dva[dt], pa, ldb_k<kR, LD>(cG, 8 * kc, 8 * dt));
        mma<kR>(dka[dt], da, ldb_k<kR, LD>(cQ, 8 * kc, 8 * dt));
      }
    }
    if constexpr (kDq) {                // Note [tf32 dQ by atomics]
      float* sS = sG + buf * kBr * LD;  // dS^T over this tile's dO (read by every warp above)
      __syncthreads();
#pragma unroll
      for (int nt = 0; nt < kBr / 8; ++nt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          *reinterpret_cast<float2*>(sS + (warp * 16 + g + 8 * r) * LDS + nt * 8 + 2 * t) =
              make_float2(dpt[nt][2 * r], dpt[nt][2 * r + 1]);
        }
      }
      __syncthreads();
      const int m0 = (warp % kMTiles) * 16, n0 = (warp / kMTiles) * kNPerWarp;
      float acc[kNPerWarp][4];
#pragma unroll
      for (int n = 0; n < kNPerWarp; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
      for (int kc = 0; kc < kBc / 8; ++kc) {
        const FragA<kR> da = lda_k<kR, LDS>(sS, 8 * kc, m0);
#pragma unroll
        for (int n = 0; n < kNPerWarp; ++n) {
          mma<kR>(acc[n], da, ldb_k<kR, LD>(sK, 8 * kc, 8 * (n0 + n)));
        }
      }
      const float sc = static_cast<float>(p.scale);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int query = q0 + m0 + g + 8 * r;
        if (query < p.L) {
          float* out = dq + p.dg.dq(b, h, query);
#pragma unroll
          for (int n = 0; n < kNPerWarp; ++n) {
            add_pair(out + 8 * (n0 + n) + 2 * t, acc[n][2 * r] * sc, acc[n][2 * r + 1] * sc);
          }
        }
      }
    }
    __syncthreads();  // the next iteration refills this buffer
  }
  cpa_wait<0>();

  const float sc = static_cast<float>(p.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_lo + 8 * r;
    bool bad = false;
    if (key < p.S) {
      const int64_t base = p.dg.kv(b, h, key);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const float2 wk = make_float2(dka[dt][2 * r] * sc, dka[dt][2 * r + 1] * sc);
        const float2 wv = make_float2(dva[dt][2 * r], dva[dt][2 * r + 1]);
        bad |= !isfinite(wk.x) || !isfinite(wk.y) || !isfinite(wv.x) || !isfinite(wv.y);
        *reinterpret_cast<float2*>(dk + base + dt * 8 + 2 * t) = wk;
        *reinterpret_cast<float2*>(dv + base + dt * 8 + 2 * t) = wv;
      }
    }
    for_bad_rows(bad, [&](int gi) {  // Note [non-finite rows] (attention_rows.cuh)
      const int kj = key - g + gi;
      const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
      fix_dkdv_row<float>(ra, qb, kb, vb, gb, lse + static_cast<int64_t>(bh) * p.L,
                          dvec + static_cast<int64_t>(bh) * p.L, kj, dk + p.dg.kv(b, h, kj),
                          dv + p.dg.kv(b, h, kj));
    });
  }
}

// Backward, dQ.  kWarps warps own kBr = 16 kWarps queries and loop over key tiles of kBc
// (double-buffered K, V).  Per tile, per warp: S = Q K^T, dP = dO V^T, P = exp(S scale - lse),
// dS = P (dP - Dvec), dQ += dS K (times scale at the end).
template <int D, int kPrec, int kWarps, int kBc>
__global__ void __launch_bounds__(kWarps * 32)
    attn_bwd_dq_tf32_k(AttnTf32Args p, const float* __restrict__ q, const float* __restrict__ k,
                       const float* __restrict__ v, const float* __restrict__ gr,
                       const float* __restrict__ lse, const float* __restrict__ dvec,
                       float* __restrict__ dq) {
  constexpr bool kS = kPrec >= 1, kR = kPrec == 2;  // Note [scores in 3xTF32]
  constexpr int kBr = 16 * kWarps, NT = kWarps * 32, LD = D + 4, KC = D / 8;
  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);  // kBr x LD
  float* sG = sQ + kBr * LD;                      // kBr x LD
  float* sK = sG + kBr * LD;                      // 2 x kBc x LD
  float* sV = sK + 2 * kBc * LD;                  // 2 x kBc x LD
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBr;
  const float* qb = q + b * p.q_b + h * p.q_h;
  const float* kb = k + b * p.k_b + h * p.k_h;
  const float* vb = v + b * p.v_b + h * p.v_h;
  const float* gb = gr + b * p.g_b + h * p.g_h;
  const int kend = p.causal ? min(q0 + kBr, p.S) : p.S;
  const int nkb = (kend + kBc - 1) / kBc;

  load_rows<kBr, D, NT>(sQ, qb, p.q_l, q0, p.L);
  load_rows<kBr, D, NT>(sG, gb, p.g_l, q0, p.L);
  cpa_commit();
  load_rows<kBc, D, NT>(sK, kb, p.k_l, 0, p.S);
  load_rows<kBc, D, NT>(sV, vb, p.v_l, 0, p.S);
  cpa_commit();
  const int row_lo = q0 + warp * 16 + g;
  float lse2[2], dvr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    const bool ok = row < p.L;
    lse2[r] = ok ? lse[static_cast<int64_t>(bh) * p.L + row] * kLog2eF : 0.f;
    dvr[r] = ok ? dvec[static_cast<int64_t>(bh) * p.L + row] : 0.f;
  }
  float dqa[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dqa[i][0] = dqa[i][1] = dqa[i][2] = dqa[i][3] = 0.f;
  const float sl2 = static_cast<float>(p.scale) * kLog2eF;

  for (int j = 0; j < nkb; ++j) {
    if (j + 1 < nkb) {
      const int nb = (j + 1) & 1;
      load_rows<kBc, D, NT>(sK + nb * kBc * LD, kb, p.k_l, (j + 1) * kBc, p.S);
      load_rows<kBc, D, NT>(sV + nb * kBc * LD, vb, p.v_l, (j + 1) * kBc, p.S);
    }
    cpa_commit();
    cpa_wait<1>();
    __syncthreads();
    const float* cK = sK + (j & 1) * kBc * LD;
    const float* cV = sV + (j & 1) * kBc * LD;

    float s[kBc / 8][4], dpv[kBc / 8][4];
#pragma unroll
    for (int n = 0; n < kBc / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dpv[n][e] = 0.f;
    }
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
      const FragA<kS> qa = lda<kS, LD>(sQ, warp * 16, 8 * kc);
      const FragA<kR> ga = lda<kR, LD>(sG, warp * 16, 8 * kc);
#pragma unroll
      for (int nt = 0; nt < kBc / 8; ++nt) {
        mma<kS>(s[nt], qa, ldb_n<kS, LD>(cK, 8 * nt, 8 * kc));
        mma<kR>(dpv[nt], ga, ldb_n<kR, LD>(cV, 8 * nt, 8 * kc));
      }
    }
    const int k0 = j * kBc;
    const bool need_mask = k0 + kBc > p.S || (p.causal && k0 + kBc - 1 > q0 + warp * 16);
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float pv = ex2(fmaf(s[nt][e], sl2, -lse2[r]));
        if (need_mask) {
          const int col = k0 + nt * 8 + 2 * t + (e & 1), row = row_lo + 8 * r;
          if (col >= p.S || (p.causal && col > row)) pv = 0.f;
        }
        dpv[nt][e] = pv * (dpv[nt][e] - dvr[r]);
      }
    }
    // dQ += dS K (keys as k)
#pragma unroll
    for (int kc = 0; kc < kBc / 8; ++kc) {
      const FragA<kR> da = a_from_c<kR>(dpv[kc]);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        mma<kR>(dqa[dt], da, ldb_k<kR, LD>(cK, 8 * kc, 8 * dt));
      }
    }
    __syncthreads();
  }

  const float sc = static_cast<float>(p.scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_lo + 8 * r;
    bool bad = false;
    if (row < p.L) {
      float* out = dq + p.dg.dq(b, h, row);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const float2 w = make_float2(dqa[dt][2 * r] * sc, dqa[dt][2 * r + 1] * sc);
        bad |= !isfinite(w.x) || !isfinite(w.y);
        *reinterpret_cast<float2*>(out + dt * 8 + 2 * t) = w;
      }
    }
    for_bad_rows(bad, [&](int gi) {  // Note [non-finite rows] (attention_rows.cuh)
      const int ri = row - g + gi;
      const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
      fix_dq_row<float>(ra, qb, kb, vb, gb, lse + static_cast<int64_t>(bh) * p.L,
                        dvec + static_cast<int64_t>(bh) * p.L, ri, dq + p.dg.dq(b, h, ri));
    });
  }
}

// Note [non-finite rows] for the fused backward, whose dq rows are sums of atomics from many
// blocks: checked once they are complete, a warp a row (a read of dq), bad rows recomputed.
__global__ void __launch_bounds__(256, 8)
    attn_fix_dq_tf32_k(AttnTf32Args p, const float* __restrict__ q, const float* __restrict__ k,
                       const float* __restrict__ v, const float* __restrict__ gr,
                       const float* __restrict__ lse, const float* __restrict__ dvec,
                       float* __restrict__ dq) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) / 32;  // (b, h, l)
  if (row >= static_cast<int64_t>(p.B) * p.H * p.L) return;                         // whole warps
  const int l = static_cast<int>(row % p.L), bh = static_cast<int>(row / p.L);
  const int b = bh / p.H, h = bh % p.H;
  float* out = dq + p.dg.dq(b, h, l);
  bool bad = false;
  for (int d = threadIdx.x % 32; d < p.D; d += 32) bad |= !isfinite(out[d]);
  if (!__any_sync(0xffffffffu, bad)) return;
  __syncwarp();
  const RowsArgs ra{p.L, p.S, p.D, p.q_l, p.k_l, p.v_l, p.g_l, p.scale, p.causal};
  fix_dq_row<float>(ra, q + b * p.q_b + h * p.q_h, k + b * p.k_b + h * p.k_h,
                    v + b * p.v_b + h * p.v_h, gr + b * p.g_b + h * p.g_h,
                    lse + static_cast<int64_t>(bh) * p.L, dvec + static_cast<int64_t>(bh) * p.L, l,
                    out);
}

// dq = 0 where GradLayout puts it (before the fused backward adds into it): one float2 per
// thread, rows of D (even) floats.
__global__ void attn_zero_dq_tf32_k(AttnTf32Args p, float* __restrict__ dq) {
  const int64_t pairs = static_cast<int64_t>(p.B) * p.H * p.L * (p.D / 2);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (p.D / 2);
    const int c = static_cast<int>(i % (p.D / 2)) * 2;
    const int l = static_cast<int>(row % p.L);
    const int bh = static_cast<int>(row / p.L);
    *reinterpret_cast<float2*>(dq + p.dg.dq(bh / p.H, bh % p.H, l) + c) = make_float2(0.f, 0.f);
  }
}

// ---- configurations ----------------------------------------------------------------------------
// Forward: kFwdWarps warps x kFwdMT m-tiles of 16 query rows, kFwdBc keys per tile.  dK/dV:
// 16 kKvWarps keys per block, kKvBr queries per tile.  dQ: 16 kDqWarps queries, kDqBc keys.
// kFwdQReg: the warp's Q fragments in registers, unless they are 3xTF32 (twice the registers).
template <int D, int kPrec>
struct Tf32Config;
template <int kPrec>
struct Tf32Config<64, kPrec> {
  static constexpr int kFwdWarps = 4, kFwdBc = 64, kFwdMT = 2;
  static constexpr bool kFwdQReg = kPrec == 0;
  static constexpr int kKvWarps = 4, kKvBr = 64;
  static constexpr int kDqWarps = 4, kDqBc = 64;
};
template <int kPrec>
struct Tf32Config<128, kPrec> {
  static constexpr int kFwdWarps = 4, kFwdBc = 32, kFwdMT = 1;
  static constexpr bool kFwdQReg = kPrec == 0;
  static constexpr int kKvWarps = 4, kKvBr = 32;
  static constexpr int kDqWarps = 4, kDqBc = 32;
};

}  // namespace

// ==== launchers ================================================================================

namespace {

template <typename K>
void set_smem_tf32(K kernel, size_t bytes, const char* op) {
  if (bytes > 48 * 1024) {
    BT_CUDA_CHECK(op, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes)));
  }
}

unsigned blocks_of(int n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

template <int D, int kPrec>
void launch_fwd(const AttnTf32Args& a, const float* q, const float* k, const float* v, float* o,
                float* lse, cudaStream_t st, const char* op) {
  using C = Tf32Config<D, kPrec>;
  constexpr int W = C::kFwdWarps, Bc = C::kFwdBc, MT = C::kFwdMT, Br = 16 * MT * W;
  const size_t smem = static_cast<size_t>(Br + 4 * Bc) * (D + 4) * sizeof(float);
  auto kern = attn_fwd_tf32_k<D, kPrec, W, Bc, MT, C::kFwdQReg>;
  set_smem_tf32(kern, smem, op);
  dim3 grid(a.B * a.H, blocks_of(a.L, Br));
  kern<<<grid, W * 32, smem, st>>>(a, q, k, v, o, lse);
  BT_CUDA_LAUNCH_CHECK(op);
}

template <int D, int kPrec>
void launch_bwd(const AttnTf32Args& a, const float* q, const float* k, const float* v,
                const float* g, const float* lse, const float* dvec, float* dq, float* dk,
                float* dv, cudaStream_t st, const char* op) {
  using C = Tf32Config<D, kPrec>;
  {
    constexpr int W = C::kKvWarps, Br = C::kKvBr, Bc = 16 * W;
    const size_t smem =
        static_cast<size_t>(2 * Bc + 4 * Br) * (D + 4) * sizeof(float) + 4 * Br * sizeof(float);
    dim3 grid(a.B * a.H, blocks_of(a.S, Bc));
    if (a.fused_dq) {
      const int64_t pairs = static_cast<int64_t>(a.B) * a.H * a.L * (D / 2);
      const unsigned zb = static_cast<unsigned>(std::min<int64_t>((pairs + 255) / 256, 132 * 16));
      attn_zero_dq_tf32_k<<<zb, 256, 0, st>>>(a, dq);
      BT_CUDA_LAUNCH_CHECK(op);
      auto kern = attn_bwd_dkdv_tf32_k<D, kPrec, W, Br, true>;
      set_smem_tf32(kern, smem, op);
      kern<<<grid, W * 32, smem, st>>>(a, q, k, v, g, lse, dvec, dk, dv, dq);
      BT_CUDA_LAUNCH_CHECK(op);
      const int64_t rows = static_cast<int64_t>(a.B) * a.H * a.L;
      attn_fix_dq_tf32_k<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, st>>>(
          a, q, k, v, g, lse, dvec, dq);
      BT_CUDA_LAUNCH_CHECK(op);
      return;
    }
    auto kern = attn_bwd_dkdv_tf32_k<D, kPrec, W, Br>;
    set_smem_tf32(kern, smem, op);
    kern<<<grid, W * 32, smem, st>>>(a, q, k, v, g, lse, dvec, dk, dv, nullptr);
    BT_CUDA_LAUNCH_CHECK(op);
  }
  {
    constexpr int W = C::kDqWarps, Bc = C::kDqBc, Br = 16 * W;
    const size_t smem = static_cast<size_t>(2 * Br + 4 * Bc) * (D + 4) * sizeof(float);
    auto kern = attn_bwd_dq_tf32_k<D, kPrec, W, Bc>;
    set_smem_tf32(kern, smem, op);
    dim3 grid(a.B * a.H, blocks_of(a.L, Br));
    kern<<<grid, W * 32, smem, st>>>(a, q, k, v, g, lse, dvec, dq);
    BT_CUDA_LAUNCH_CHECK(op);
  }
}

}  // namespace

bool attn_tf32_supported(const AttnTf32Args& a) {
  const auto m4 = [](int64_t s) { return s % 4 == 0; };
  if (a.D != 64 && a.D != 128) return false;
  if (a.B < 1 || a.H < 1 || a.L < 1 || a.S < 1 || (a.causal && a.L != a.S)) return false;
  if (static_cast<int64_t>(a.B) * a.H > 0x7fffffff || std::max(a.L, a.S) > 65535 * 16) {
    return false;
  }
  if (!(m4(a.q_b) && m4(a.q_h) && m4(a.q_l) && m4(a.k_b) && m4(a.k_h) && m4(a.k_l) && m4(a.v_b) &&
        m4(a.v_h) && m4(a.v_l))) {
    return false;
  }
  // g is only read by the backward; a default-constructed (zero) g stride passes
  return m4(a.g_b) && m4(a.g_l) && m4(a.g_h) && a.dg.even();
}

namespace {

// kPrec (Note [scores in 3xTF32]) from the arguments, as a compile-time constant.
template <typename F>
void with_prec(const AttnTf32Args& a, F&& f) {
  switch (a.prec) {
    case kTf32All:
      return f(std::integral_constant<int, kTf32All>{});
    case kTf32Scores:
      return f(std::integral_constant<int, kTf32Scores>{});
    default:
      return f(std::integral_constant<int, kTf32None>{});
  }
}

}  // namespace

void attn_fwd_tf32(const AttnTf32Args& a, const float* q, const float* k, const float* v, float* o,
                   float* lse, cudaStream_t st, const char* op) {
  with_prec(a, [&](auto prec) {
    constexpr int P = decltype(prec)::value;
    a.D == 64 ? launch_fwd<64, P>(a, q, k, v, o, lse, st, op)
              : launch_fwd<128, P>(a, q, k, v, o, lse, st, op);
  });
}

void attn_bwd_tf32(const AttnTf32Args& a, const float* q, const float* k, const float* v,
                   const float* g, const float* lse, const float* dvec, float* dq, float* dk,
                   float* dv, cudaStream_t st, const char* op) {
  with_prec(a, [&](auto prec) {
    constexpr int P = decltype(prec)::value;
    a.D == 64 ? launch_bwd<64, P>(a, q, k, v, g, lse, dvec, dq, dk, dv, st, op)
              : launch_bwd<128, P>(a, q, k, v, g, lse, dvec, dq, dk, dv, st, op);
  });
}

}  // namespace bt::cuda
