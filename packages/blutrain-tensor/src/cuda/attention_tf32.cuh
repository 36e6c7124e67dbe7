// cuda/attention_tf32.cuh: flash attention for float32 on tensor cores (TF32 / 3xTF32).
//
// Same semantics as the FlashAttention kernels of attention.cu (see attention.h): q, k, v are
// (B, H, L|S, D) views (element strides *_b, *_h, *_l, unit D stride); o is written (B, L, H, D)
// contiguous, lse (B, H, L) float32 (natural log).  The backward reads g = dO as a (B, L, H, D)
// view (g_b, g_l, g_h), lse and dvec = rowsum(dO * O) - dlse (B, H, L) float32, and writes dq
// and dk, dv where GradLayout says.
// prec: which products run in 3xTF32 (big * big + big * small + small * big, fp32-accurate)
// rather than 1xTF32 (Note [scores in 3xTF32] in attention_tf32.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace bt::cuda {

// Where the backward writes dq, dk, dv (unit D stride): element (b, h, l, d) of dq at b dq_b +
// h dq_h + l dq_l + d, of dk / dv at b kv_b + h kv_h + l kv_l + d.  from_rows: (B, L|S, H, D)
// rows d_row apart (H D contiguous, 3 H D for the slices of a packed (B, T, 3 H D) gradient);
// separate (B, H, L|S, D) leaves get their own layout (heads-major strides), so no copy follows.
struct GradLayout {
  int64_t dq_b, dq_h, dq_l, kv_b, kv_h, kv_l;
  __host__ __device__ int64_t dq(int b, int h, int64_t l) const {
    return b * dq_b + h * dq_h + l * dq_l;
  }
  __host__ __device__ int64_t kv(int b, int h, int64_t s) const {
    return b * kv_b + h * kv_h + s * kv_l;
  }
  static GradLayout from_rows(int L, int S, int D, int64_t d_row) {
    return {L * d_row, D, d_row, S * d_row, D, d_row};
  }
  // every stride even: the kernels store pairs of elements
  bool even() const {
    return dq_b % 2 == 0 && dq_h % 2 == 0 && dq_l % 2 == 0 && kv_b % 2 == 0 && kv_h % 2 == 0 &&
           kv_l % 2 == 0;
  }
};

// The kernels' kPrec: every product 1xTF32, the scores Q K^T (forward and the backward's
// recomputation) 3xTF32, or every product 3xTF32.
enum Tf32Prec : int { kTf32None = 0, kTf32Scores = 1, kTf32All = 2 };

struct AttnTf32Args {
  int B, H, L, S, D;
  int64_t q_b, q_h, q_l, k_b, k_h, k_l, v_b, v_h, v_l;
  int64_t g_b, g_l, g_h;
  GradLayout dg;
  double scale;
  bool causal;
  Tf32Prec prec = kTf32None;
  // Backward: dQ by float atomics from the dK / dV kernel (one kernel, not deterministic) instead
  // of its own kernel.  Note [tf32 dQ by atomics] in attention_tf32.cu.
  bool fused_dq = false;
};

// D in {64, 128}, L, S >= 1 (L == S when causal), strides multiples of 4 elements (16-byte rows),
// dg's strides even, grid limits.  The caller checks that the q, k, v, g pointers are 16-byte
// aligned and the dq, dk, dv pointers 8-byte aligned.
bool attn_tf32_supported(const AttnTf32Args& a);

void attn_fwd_tf32(const AttnTf32Args& a, const float* q, const float* k, const float* v, float* o,
                   float* lse, cudaStream_t st, const char* op);

void attn_bwd_tf32(const AttnTf32Args& a, const float* q, const float* k, const float* v,
                   const float* g, const float* lse, const float* dvec, float* dq, float* dk,
                   float* dv, cudaStream_t st, const char* op);

}  // namespace bt::cuda
