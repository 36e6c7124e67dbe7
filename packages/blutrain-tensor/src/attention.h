// attention.h: fused (flash) attention, forward and backward.
//
// FlashAttention: inputs q (B, H, L, D), k (B, H, S, D), v (B, H, S, D): any strides on B, H and
// the sequence dim, unit stride on D (GPT-2 makes them by splitting a (B, T, 3C) linear output and
// transposing: no copy is made).  Outputs:
//   o   (B, L, H, D) contiguous: flash_attention() returns it permuted to (B, H, L, D), so the
//       caller's y.transpose(1, 2) is contiguous again and .view(B, L, H * D) costs no copy;
//   lse (B, H, L) float32 (float64 for float64 inputs): each row's logsumexp of
//       q k^T * scale (natural log), saved for the backward (finite: a causal row always has
//       its diagonal).
// Causal masks are the top-left aligned tril (key j visible to query i iff j <= i), with L == S
// on the fused path.  The backward primitive takes q, k, v, o, do (B, L, H, D), lse and dlse
// (the cotangent of lse, lse's dtype; undefined when none flowed) and returns dq, dk, dv as
// (B, L|S, H, D) contiguous tensors (the vjp permutes them back to (B, H, ., D) views).
// Deterministic (no atomics) under use_deterministic_algorithms; otherwise the bf16/fp16 CUDA
// backward adds dq with float32 atomics (dk, dv stay bitwise reproducible).
#pragma once

#include <utility>
#include <vector>

#include "primitives.h"

namespace bt {

class FlashAttention : public Primitive {
  BT_PRIM_BODY(FlashAttention, "flash_attention")
  FlashAttention(double s, bool c) : scale(s), causal(c) {}
  bool saves_outputs() const override { return true; }
  bool takes_no_cotangent(size_t i) const override { return i == 1; }  // lse: dlse undefined
  void attrs(Attrs& a) const override {
    a["scale"] = scale;
    a["causal"] = causal;
  }
  double scale;
  bool causal;
};

// Outputs dq, dk, dv: (B, L|S, H, D) (heads_major false; the packed backward's slices too) or
// (B, H, L|S, D) (heads_major: the layout of contiguous (B, H, T, D) leaves, so their gradients
// need no copy).
class FlashAttentionBackward : public Primitive {
  BT_PRIM_BODY(FlashAttentionBackward, "flash_attention_backward")
  FlashAttentionBackward(double s, bool c, bool hm = false)
      : scale(s), causal(c), heads_major(hm) {}
  bool saves_inputs() const override { return false; }
  bool differentiable() const override { return false; }
  void attrs(Attrs& a) const override {
    a["scale"] = scale;
    a["causal"] = causal;
    a["heads_major"] = heads_major;
  }
  double scale;
  bool causal;
  bool heads_major;
};

// FlashAttentionBackward's outputs seen as (B, L|S, H, D) views (a permuted view where
// heads_major), as the kernels index them.
std::vector<Tensor> attention_grad_rows(const std::vector<Tensor>& out, bool heads_major);

// Packed self-attention: the single input X (B, T, 3 H D) with unit last stride (rows of 3 H D
// may have a larger row stride) holds q, k, v as its three split(H D, -1) slices, each viewed
// (B, T, H, D) and seen as (B, H, T, D).  Outputs as FlashAttention's.  Its backward writes dq,
// dk, dv straight into one contiguous (B, T, 3 H D) gradient of X: autograd hands X a single
// gradient, with no slice_scatter of three zero-filled buffers.
class FlashAttentionPacked : public Primitive {
  BT_PRIM_BODY(FlashAttentionPacked, "flash_attention_packed")
  FlashAttentionPacked(double s, bool c, int64_t h) : scale(s), causal(c), heads(h) {}
  bool saves_outputs() const override { return true; }
  bool takes_no_cotangent(size_t i) const override { return i == 1; }  // lse: dlse undefined
  void attrs(Attrs& a) const override {
    a["scale"] = scale;
    a["causal"] = causal;
    a["heads"] = heads;
  }
  double scale;
  bool causal;
  int64_t heads;
};

// inputs X, o, do, lse, dlse; output dX (B, T, 3 H D) contiguous.
class FlashAttentionPackedBackward : public Primitive {
  BT_PRIM_BODY(FlashAttentionPackedBackward, "flash_attention_packed_backward")
  FlashAttentionPackedBackward(double s, bool c, int64_t h) : scale(s), causal(c), heads(h) {}
  bool saves_inputs() const override { return false; }
  bool differentiable() const override { return false; }
  void attrs(Attrs& a) const override {
    a["scale"] = scale;
    a["causal"] = causal;
    a["heads"] = heads;
  }
  double scale;
  bool causal;
  int64_t heads;
};

// The (B, H, T, D) q, k, v views (no autograd) of a packed X (B, T, 3 H D) (kernel plumbing).
std::vector<Tensor> packed_qkv_views(const Tensor& x, int64_t heads);
// The (B, T, H, D) dq, dk, dv views of a packed gradient dX (B, T, 3 H D).
std::vector<Tensor> packed_grad_views(const Tensor& dx, int64_t heads);

// When q, k, v (B, H, T, D) are exactly the three split(H D, -1) slices of one (B, T, 3 H D)
// tensor viewed (B, T, H, D) and transposed (checked on strides and storage offsets), made from
// their storage's base tensor by views only (no hooks, retain_grad or in-place rebase on the way,
// all three requiring grad): a differentiable (B, T, 3 H D) view of that base whose gradient
// is exactly what flows through q, k, v.  Else an undefined tensor (callers take the unpacked
// path).
Tensor packed_qkv_source(const Tensor& q, const Tensor& k, const Tensor& v);

// The packed op: (o as a (B, H, T, D) view of a (B, T, H, D) contiguous tensor, lse (B, H, T)).
std::pair<Tensor, Tensor> flash_attention_packed(const Tensor& x, int64_t heads, bool causal,
                                                 double scale);

// Whether the fused kernel can run these inputs on their device (else the caller composes
// matmul + softmax): 4-D q, k, v of one float dtype with equal B, H, equal head dims, L == S
// when causal, L, S >= 1; on CUDA any D <= 256 (tensor cores for bf16/fp16 and float32 with D in
// {64, 128} and 16-byte aligned rows: float32 as TF32, or 3xTF32 when float32_matmul_precision()
// is "highest"; an exact SIMT kernel otherwise).
bool flash_attention_supported(const Tensor& q, const Tensor& k, const Tensor& v, bool causal);

// The fused op (no mask, no dropout): returns o as a (B, H, L, D) view of a (B, L, H, D)
// contiguous tensor, and lse (B, H, L) float32 (float64 for float64 inputs).  Throws (naming the op
// and shapes) when flash_attention_supported() is false.
std::pair<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                          bool causal, double scale);

// Whether scaled_dot_product_attention uses the fused kernel on the CPU too (default off: the
// composed path runs the CPU's GEMMs; BLUTRAIN_FLASH_ATTENTION_CPU=1 turns it on at start).
bool flash_attention_cpu();
void set_flash_attention_cpu(bool on);

}  // namespace bt
