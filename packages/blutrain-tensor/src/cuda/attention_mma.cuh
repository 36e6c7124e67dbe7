// cuda/attention_mma.cuh: what the tensor-core flash-attention kernels share (attention.cu
// for mma.sync, attention_sm90.cu for Hopper wgmma): the parameter block, cp.async and
// ldmatrix wrappers, the bf16/fp16 mma, the swizzled shared-memory tile layout and its loaders.
// Include only from .cu files.
//
// mma.sync.m16n8k16 (.bf16/.f16 inputs, f32 accumulators) register layouts, with
// g = lane / 4 (groupID) and t = lane % 4 (thread in group); each .b32 register holds two 16-bit
// elements, the lower column (or k) index in the low half:
//   A (16 x 16, row major), a0..a3:  a0 = A[g][2t..2t+1]      a1 = A[g+8][2t..2t+1]
//                                    a2 = A[g][2t+8..2t+9]    a3 = A[g+8][2t+8..2t+9]
//   B (16 x 8, "col": k fastest), b0..b1:  b0 = B[2t..2t+1][g]   b1 = B[2t+8..2t+9][g]
//   C (16 x 8 f32), c0..c3:  c0, c1 = C[g][2t], C[g][2t+1]    c2, c3 = C[g+8][2t], C[g+8][2t+1]
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register ri of every lane
// holds matrix i's row (lane / 4), columns 2 (lane % 4) + {0, 1}; with .trans it holds rows
// 2 (lane % 4) + {0, 1} of column (lane / 4) instead.  Hence:
//   * A from a row-major tile X[m][k]: lane l points at X[m0 + l % 16][k0 + 8 (l / 16)].
//   * B[k][n] = Y[n][k] from a tile stored n-major (K for S = Q K^T): matrices (n0, k0),
//     (n0, k0 + 8), (n0 + 8, k0), (n0 + 8, k0 + 8): lane l points at
//     Y[n0 + l % 8 + 8 (l / 16)][k0 + 8 ((l / 8) % 2)];
//     r0, r1 = b0, b1 of n-tile n0; r2, r3 = b0, b1 of n-tile n0 + 8.
//   * B[k][n] = Y[k][n] from a tile stored k-major (V for O = P V): .trans, matrices (k0, n0),
//     (k0 + 8, n0), (k0, n0 + 8), (k0 + 8, n0 + 8): lane l points at
//     Y[k0 + l % 16][n0 + 8 (l / 16)].
//   * C -> A (P = softmax(S) reused as the A operand): the C tiles of columns 16kk..16kk+15
//     (n-tiles 2kk, 2kk+1) give a0 = pack(c0, c1) of 2kk, a1 = pack(c2, c3) of 2kk, and a2, a3
//     likewise of 2kk+1.
// Shared-memory tiles are rows of D 16-bit elements in 16-byte chunks, chunk c of row r stored at
// chunk c ^ (r % 8) (XOR swizzle: the 8 rows an ldmatrix reads hit 8 different bank groups).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention_tf32.cuh"  // GradLayout

namespace bt::cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct AttnParams {
  int B, H, L, S, D;
  int64_t q_b, q_h, q_l;  // element strides of q (B, H, L, D), unit D stride
  int64_t k_b, k_h, k_l;
  int64_t v_b, v_h, v_l;
  int64_t o_b, o_l, o_h;     // o and do: (B, L, H, D) views
  int64_t g_b, g_l, g_h;     // do
  int64_t dl_b, dl_h, dl_l;  // dlse (B, H, L), any strides (a broadcast zero is common)
  GradLayout dg;             // where dq, dk, dv go (attention_tf32.cuh)
  double scale;
  bool causal;
  // Note [packed column sums] (attention.h): where not null (packed backward, L == S, no dlse),
  // partial column sums of dq, dk, dv over each 16 rows: cs (B cs_groups, 3 H D) float32, row
  // b cs_groups + l / 16, column j H D + h D + d for j = q, k, v (cs_groups = ceil(L / 16)).
  float* cs = nullptr;
  int cs_groups = 0;
};

// Hopper forward (attention_sm90.cu): supported() says whether it can run p on the current
// device (built for sm_90a, compute capability 9.0, D 64 or 128); q, k, v rows 16-byte aligned.
bool attn_fwd_sm90_supported(const AttnParams& p);
template <typename T>
void attn_fwd_sm90(const AttnParams& p, const T* q, const T* k, const T* v, T* o, float* lse,
                   cudaStream_t st, const char* op);
// Hopper backward (D 64): dK, dV into dk / dv, dQ added into the zeroed float32 dq_acc (B, H, L,
// D) for attn_bwd_dq_convert; *bad_keys (zeroed before) set to 1 when a key row it stored is not
// finite, for the conversion to recompute (Note [no calls in wgmma kernels]).  False (nothing
// launched) where it does not apply.
template <typename T>
bool attn_bwd_sm90(const AttnParams& p, const T* q, const T* k, const T* v, const T* g,
                   const float* lse, const float* dvec, float* dq_acc, T* dk, T* dv, int* bad_keys,
                   cudaStream_t st, const char* op);

namespace {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}
// 16-byte async copy; pred false zero-fills the destination (src is then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool pred) {
  const int n = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// c += a * b (16x8x16), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// Two floats -> one .b32 of two 16-bit elements (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// The two floats pack2 rounded (what was stored).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
  }
}

// 2^x with the MUFU instruction (what exp2f compiles to under --use_fast_math); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 16-byte float atomic add (one instruction from sm_90; four before); addr 16-byte aligned.
__device__ __forceinline__ void red_add_v4(float* addr, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(addr, a), atomicAdd(addr + 1, b), atomicAdd(addr + 2, c), atomicAdd(addr + 3, d);
#endif
}
// Adds one 16 x 8 C tile (c0..c3: rows g, g + 8 of columns 2t, 2t + 1) to float memory with half
// the atomics: lanes t and t ^ 1 swap halves, so the even lane adds row g, columns 2t .. 2t + 3
// and the odd lane row g + 8, columns 2t - 2 .. 2t + 1.  dst: the lane's row (g, or g + 8 when
// odd) at column 2 (t & 2) of the tile; ok: that row exists.  All 32 lanes must call it.
__device__ __forceinline__ void red_add_c_tile(float* dst, float c0, float c1, float c2, float c3,
                                               bool odd, bool ok) {
  const float r0 = __shfl_xor_sync(0xffffffffu, odd ? c0 : c2, 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, odd ? c1 : c3, 1);
  if (ok) {
    if (odd) {
      red_add_v4(dst, r0, r1, c2, c3);
    } else {
      red_add_v4(dst, c0, c1, r0, r1);
    }
  }
}

// Element offset of (row, 16-byte chunk) in a swizzled tile of rows of D elements.
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}
// Async copy of rows [row0, row0 + R) of a (rows, D) global matrix with row stride `ld` into a
// swizzled tile; rows >= nrows are zero-filled.  Called by all NT threads of the block.
template <int R, int D, int NT, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t ld, int row0, int nrows) {
  constexpr int C = D / 8;
  const int tid = threadIdx.x;
#pragma unroll
  for (int idx = tid; idx < R * C; idx += NT) {
    const int r = idx / C, c = idx % C;
    const bool ok = row0 + r < nrows;
    const T* s = ok ? src + (row0 + r) * ld + c * 8 : src;
    cp_async16(smem_u32(tile + swz<D>(r, c)), s, ok);
  }
}
// Async copy of n floats (rows >= nrows zero-filled).
template <int R, int NT>
__device__ __forceinline__ void load_vec(float* dst, const float* src, int row0, int nrows) {
  for (int r = threadIdx.x; r < R; r += NT) {
    const bool ok = row0 + r < nrows;
    cp_async4(smem_u32(dst + r), ok ? src + row0 + r : src, ok);
  }
}

}  // namespace

}  // namespace bt::cuda
