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

#include <optional>
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

// inputs X, o, do, lse, dlse; output dX (B, T, 3 H D) contiguous, and with colsum its column sums
// (3 H D) (float32; float64 for float64): the qkv bias's gradient (Note [packed column sums]).
class FlashAttentionPackedBackward : public Primitive {
  BT_PRIM_BODY(FlashAttentionPackedBackward, "flash_attention_packed_backward")
  FlashAttentionPackedBackward(double s, bool c, int64_t h, bool cs = false)
      : scale(s), causal(c), heads(h), colsum(cs) {}
  bool saves_inputs() const override { return false; }
  bool differentiable() const override { return false; }
  void attrs(Attrs& a) const override {
    a["scale"] = scale;
    a["causal"] = causal;
    a["heads"] = heads;
    a["colsum"] = colsum;
  }
  double scale;
  bool causal;
  int64_t heads;
  bool colsum;
};

// Note [packed column sums]
// A linear layer's bias gradient is the column sums of its output's gradient: for GPT-2's qkv
// projection a separate pass over attention's (B T, 3 C) dX (75 MB a layer in bf16).
// QkvAttention (the projection and the attention in one node) asks FlashAttentionPackedBackward
// for those sums, and two identities of softmax attention (no lse cotangent) make them cheap:
//   k: zero.  k's bias adds q_i . b to every score of query i, a shift softmax ignores (dS's rows
//      sum to 0), so the kernels write 0 rather than the rounding noise of summing dK;
//   v: sum over keys of dV = sum over queries of P^T dO = sum over queries of dO (P's rows sum to
//      1): column sums of dO, read anyway by the backward's preprocess (which computes Dvec);
//   q: summed by the dq conversion kernel, over the values it stores (rounded).
// Both kernels write float32 partials over 16 rows (B ceil(T / 16), 3 C) that the column-sum
// kernels add up: fixed trees and orders, deterministic.  This runs on the bf16 / fp16 one-kernel
// backward (D 64); every other path (deterministic mode, D 128, float32, an lse cotangent) sums
// the stored dX afterwards.  The values equal the composition's up to rounding (exactly 0 for k,
// where the composition returns its rounding noise).

// QkvAttention: y = attention(x W^T + b) with q, k, v the three split(H D, -1) slices of the
// projection (GPT-2's c_attn and self-attention in one node).  Inputs x (M = B T, K) rows, W
// (3 H D, K), b (3 H D) when has_bias; outputs o (B, T, H, D), lse (B, H, T) (lse_dtype), and
// qkv (M, 3 H D) (saved for the backward, never returned by the front).  Forward: the linear's
// GEMM, then FlashAttentionPacked on qkv.  Backward: FlashAttentionPackedBackward with the
// bias's column sums (Note [packed column sums]), then the dx and dW GEMMs of the linear.
class QkvAttention : public Primitive {
  BT_PRIM_BODY(QkvAttention, "qkv_attention")
  QkvAttention(double s, bool c, int64_t h, int64_t t, bool bias)
      : scale(s), causal(c), heads(h), seq(t), has_bias(bias) {}
  bool contiguous_input(size_t i) const override { return i == 2; }  // the bias
  bool saves_input(size_t i, const std::vector<bool>& needs) const override { return i < 2; }
  bool saves_outputs() const override { return true; }
  bool takes_no_cotangent(size_t i) const override { return i > 0; }  // lse, qkv
  void attrs(Attrs& a) const override {
    a["scale"] = scale;
    a["causal"] = causal;
    a["heads"] = heads;
    a["seq"] = seq;
    a["bias"] = has_bias;
  }
  double scale;
  bool causal;
  int64_t heads, seq;
  bool has_bias;
};

// The fused projection + attention of GPT-2's attention sublayer: x (B, T, K), weight (3 H D, K),
// bias (3 H D) or undefined -> (B, T, H D), the attention output before the output projection:
// the same as linear(x, weight, bias) split into q, k, v, viewed (B, H, T, D) and passed to
// scaled_dot_product_attention.  QkvAttention where the fused kernels run the packed qkv (as
// scaled_dot_product_attention decides), else that composition.
Tensor qkv_attention(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t heads,
                     bool causal, std::optional<double> scale);

// The (B, H, T, D) q, k, v views (no autograd) of a packed X (B, T, 3 H D) (kernel plumbing).
std::vector<Tensor> packed_qkv_views(const Tensor& x, int64_t heads);
// The (B, T, H, D) dq, dk, dv views of a packed gradient dX (B, T, 3 H D).
std::vector<Tensor> packed_grad_views(const Tensor& dx, int64_t heads);

// Note [causal masks skip]
// A causal row i is a function of q_i, k_0..i and v_0..i alone, in its forward and its gradients:
// masked keys (j > i) are never read, so an inf or NaN there changes nothing.  (PyTorch's math
// path multiplies a masked key's weight 0 by its value row, and its flash kernels do so within a
// tile, so an inf / NaN in a later v makes earlier rows NaN there; we document the difference,
// scaled_dot_product_attention's docstring.)  The CPU kernel loops j <= i; the composed CPU path
// hands inputs holding inf / NaN to that kernel (abs_max_cpu); the CUDA SIMT kernel loops
// j <= i too, while the tensor-core kernels' diagonal tile multiplies masked weights by v (their
// fix, Note [non-finite rows] in cuda/attention_rows.cuh, is a [gpu-pending] commit).
//
// Note [empty rows]
// A row whose scores are all -inf (every key masked by attn_mask, or -inf from q k^T) weighs no
// key: its output is 0, its lse -inf (the log of an empty sum) and it passes no gradient, as
// PyTorch's scaled_dot_product_attention (math and flash) gives 0 there.  A NaN score still
// makes the row NaN.  (softmax / log_softmax / cross_entropy of such a row stay NaN, as PyTorch;
// their lse statistic is -inf on both backends.)

// The largest magnitude in a CPU float tensor, +inf where an element is inf or NaN (any strides;
// threads): scaled_dot_product_attention's scan (Note [causal masks skip]).
double abs_max_cpu(const Tensor& t);

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
