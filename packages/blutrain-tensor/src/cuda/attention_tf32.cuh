// cuda/attention_tf32.cuh: flash attention for float32 on tensor cores (TF32 / 3xTF32).
//
// Same semantics as the FlashAttention kernels of attention.cu (see attention.h): q, k, v are
// (B, H, L|S, D) views (element strides *_b, *_h, *_l, unit D stride); o is written (B, L, H, D)
// contiguous, lse (B, H, L) float32 (natural log).  The backward reads g = dO as a (B, L, H, D)
// view (g_b, g_l, g_h), lse and dvec = rowsum(dO * O) - dlse (B, H, L) float32, and writes dq
// (B, L, ., D) and dk, dv (B, S, ., D): row (b, l) head h starts at b * L|S * d_row + l * d_row
// + h * D (d_row = H * D for separate tensors, 3 H D for slices of a packed (B, T, 3, H, D)).
// exact: 3xTF32 (big * big + big * small + small * big, fp32-accurate), else 1xTF32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace bt::cuda {

struct AttnTf32Args {
  int B, H, L, S, D;
  int64_t q_b, q_h, q_l, k_b, k_h, k_l, v_b, v_h, v_l;
  int64_t g_b, g_l, g_h;
  int64_t d_row;
  double scale;
  bool causal;
  bool exact;
};

// D in {64, 128}, L, S >= 1 (L == S when causal), strides multiples of 4 elements (16-byte rows),
// d_row even, grid limits.  The caller checks that the q, k, v, g pointers are 16-byte aligned
// and the dq, dk, dv pointers 8-byte aligned.
bool attn_tf32_supported(const AttnTf32Args& a);

void attn_fwd_tf32(const AttnTf32Args& a, const float* q, const float* k, const float* v, float* o,
                   float* lse, cudaStream_t st, const char* op);

void attn_bwd_tf32(const AttnTf32Args& a, const float* q, const float* k, const float* v,
                   const float* g, const float* lse, const float* dvec, float* dq, float* dk,
                   float* dv, cudaStream_t st, const char* op);

}  // namespace bt::cuda
