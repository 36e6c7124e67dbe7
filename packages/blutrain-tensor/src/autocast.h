// autocast.h: precision controls and the fused linear + GELU layer.
//
//   - float32 matmul precision (PyTorch's names): "highest" = true fp32 products (the default),
//     "high" = TF32 tensor cores (operands rounded to a 10-bit mantissa, fp32 accumulation),
//     "medium" = operands rounded to bf16, fp32 accumulation. Read by every GEMM (src/cpu/
//     matmul.cpp) when it builds the blutrain-linalg descriptor; it only affects float32 GEMMs
//     (bf16/fp16 GEMMs always accumulate in fp32, float64 stays float64).
//   - the global generator's (seed, offset), so recomputation (checkpoint) replays dropout.
//   - linear_gelu(x, W, b) = gelu_tanh(x W^T + b): one GEMM whose epilogue adds the bias, applies
//     the GELU and also writes the pre-activation (saved for backward).
//   - linear_gelu_linear: the whole GELU MLP (GEMM, GELU, GEMM) as one primitive.
//   - linear_cross_entropy: a classifier head and its loss, x W^T -> cross-entropy, run in row
//     chunks so the (N, V) logits never exist whole (Note [chunked classifier]).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "primitives.h"

namespace bt {

// ---- float32 matmul precision ------------------------------------------------------------------
enum class MatmulPrecision : int { Highest = 0, High = 1, Medium = 2 };
void set_float32_matmul_precision(MatmulPrecision p);  // process-wide, thread-safe (atomic)
MatmulPrecision float32_matmul_precision();
MatmulPrecision parse_matmul_precision(const std::string& s);  // ValueError on unknown names
const char* matmul_precision_name(MatmulPrecision p);

// ---- float32 attention precision ---------------------------------------------------------------
// How the fused float32 attention kernels (CUDA, tensor cores) form their products: "matmul" (the
// default) follows the matmul precision (1xTF32 unless it is "highest"), "highest" is 3xTF32
// (float32-accurate) whatever the matmul precision says, as PyTorch's float32
// scaled_dot_product_attention (its memory-efficient kernel) is under allow_tf32, and "scores"
// is 3xTF32 for the scores Q K^T only, the other products as "matmul" (Note [scores in 3xTF32]
// in cuda/attention_tf32.cu: the scores carry most of 1xTF32's error). The CPU's attention is
// float32 either way. Process-wide, atomic; read when each attention kernel runs, so set it
// before a forward and leave it until its backward ran.
enum class AttentionPrecision : int { Matmul = 0, Highest = 1, Scores = 2 };
void set_float32_attention_precision(AttentionPrecision p);
AttentionPrecision float32_attention_precision();
AttentionPrecision parse_attention_precision(const std::string& s);  // ValueError on unknown names
const char* attention_precision_name(AttentionPrecision p);
// Whether float32 attention runs float32-accurate (3xTF32) now: either setting says "highest".
bool float32_attention_exact();
// Whether its scores Q K^T do: float32_attention_exact() or the attention precision "scores".
bool float32_attention_scores_exact();

// ---- generator state (defined in ops.cpp, next to the generator) ------------------------------
std::pair<uint64_t, uint64_t> get_rng_state();  // (seed, offset)
void set_rng_state(uint64_t seed, uint64_t offset);

// ---- fused linear + bias + tanh-GELU ---------------------------------------------------------
// Inputs: x (M, K), W (N, K)[, b (N)]; outputs: y = gelu_tanh(pre) (M, N) and pre = x W^T + b
// (M, N). eval_cpu and eval_gpu are the same blutrain-linalg call (src/cpu/matmul.cpp).
class LinearGelu : public Primitive {
  BT_PRIM_BODY(LinearGelu, "linear_gelu")
  explicit LinearGelu(bool bias) : has_bias(bias) {}
  bool contiguous_input(size_t i) const override { return i == 2; }  // the bias
  bool saves_input(size_t i, const std::vector<bool>& needs) const override { return i < 2; }
  bool saves_outputs() const override { return true; }  // pre (y is the next layer's input)
  // pre is never returned by the front: no zero-filled cotangent for it in backward
  bool takes_no_cotangent(size_t i) const override { return i == 1; }
  void attrs(Attrs& a) const override { a["bias"] = has_bias; }
  bool has_bias;
};

// Backward of a linear layer's weight: dW = g^T x (N, K) and, with bias, db = column sums of g
// (N): linalg's BGRAD_A epilogue of the same GEMM, or on CUDA our column-sum kernel after it
// (cuda::column_sums). Inputs g (M, N), x (M, K). dW / db may be float32 for 16-bit g and x.
class LinearWeightGrad : public Primitive {
  BT_PRIM_BODY(LinearWeightGrad, "linear_weight_grad")
  explicit LinearWeightGrad(bool bias) : has_bias(bias) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override { a["bias"] = has_bias; }
  bool has_bias;
};

// dpre = (g W) * gelu_tanh'(pre), with bgrad also db = column sums of dpre (g's dtype, or float32
// for a 16-bit g whose bias is a cast of a float32 master). Inputs g (M, N2),
// W (N2, N1), pre (M, N1) contiguous. CPU and LglImpl::Cublaslt: one GEMM with linalg's
// DGELU(_BGRAD) epilogue; CUDA otherwise: a plain GEMM into dpre, then our kernel in place.
class LinearDgelu : public Primitive {
  BT_PRIM_BODY(LinearDgelu, "linear_dgelu")
  explicit LinearDgelu(bool bg) : bgrad(bg) {}
  bool contiguous_input(size_t i) const override { return i == 2; }  // pre
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override { a["bgrad"] = bgrad; }
  bool bgrad;
};

// A GELU MLP: y = gelu_tanh(x W1^T + b1) W2^T + b2. Inputs x (M, K), W1 (N1, K), W2 (N2, N1),
// then b1 (N1) if has_b1, then b2 (N2) if has_b2; outputs y (M, N2), h (M, N1), pre (M, N1), or
// with recompute y and pre only (h is a temporary of the forward, recomputed in backward from
// pre for dW2: 4 B*T*C fewer saved elements per GPT-2 layer).
//   forward: 16-bit (no recompute): one GEMM with the GELU_AUX(+bias) epilogue (h and pre), then
//     h W2^T + b2. float32/64 (LglImpl::Kernel) or recompute: GEMM(+bias) writes pre, the
//     GeluTanh unary kernel writes h (the backward's recompute runs that very kernel, so h and the
//     gradients are bitwise those of recompute=False whenever this path ran both times).
//   backward: dW2/db2 one BGRAD GEMM; dpre = (dy W2) * gelu'(pre) with db1 (LinearDgelu); dW1
//     and dx GEMMs.
class LinearGeluLinear : public Primitive {
  BT_PRIM_BODY(LinearGeluLinear, "linear_gelu_linear")
  LinearGeluLinear(bool b1, bool b2, bool rc = false) : has_b1(b1), has_b2(b2), recompute(rc) {}
  bool contiguous_input(size_t i) const override { return i >= 3; }  // the biases
  bool saves_input(size_t i, const std::vector<bool>& needs) const override { return i < 3; }
  bool saves_outputs() const override { return true; }  // h and pre (pre only with recompute)
  bool saves_output(size_t i) const override { return i > 0; }  // never y
  // h and pre are never returned by the front: no zero-filled cotangents for them in backward
  // (at GPT-2's bf16 shape two 100 MB fills a layer)
  bool takes_no_cotangent(size_t i) const override { return i > 0; }
  void attrs(Attrs& a) const override {
    a["bias1"] = has_b1;
    a["bias2"] = has_b2;
    a["recompute"] = recompute;
  }
  bool has_b1, has_b2, recompute;
};

// Note [chunked classifier]
// A language model's head makes (N, V) logits, N = B*T tokens, V ~ 50K classes: at GPT-2's
// B=16, T=1024 that is 3.3 GB in float32 (1.65 in bf16), the largest tensor of the step, kept
// from the forward until the loss's backward.  LinearCrossEntropy never keeps it: its forward
// walks the rows in chunks and, per chunk, runs the head GEMM into one chunk buffer, the
// cross-entropy forward (row losses, lse), the cross-entropy backward written over that buffer
// (dlogits of the loss), then the two backward GEMMs: dx rows = dlogits W, and
// dW += dlogits^T x with beta = 1 into a float32 accumulator for 16-bit weights (one rounding at
// the end, as the unchunked GEMM's).  So the forward already holds the gradients of the loss
// (the mean's: 1 / count of non-ignored targets, counted on the device before the chunks, scales
// dlogits inside the cross-entropy kernel; not in float16, where dlogits / count would fall into
// subnormals: there the front divides the summed loss with ordinary ops, and that 1 / count
// reaches the vjp through autograd); the vjp only scales them by the incoming gradient, in
// place with the multi-tensor scale kernel on the node's last run (Note [donating a saved
// input]), which returns at once when that gradient is 1 (loss.backward()).  Folding the mean
// in saved GPT-2 a (50304, 768) float32 and a (16384, 768) scaling pass a step (~0.09 ms).
// Costs: the same GEMM flops as linear + cross_entropy; the backward's work moves into the
// forward (dx and dW are computed even if no backward follows, unless grad mode is off or
// neither x nor W requires grad).  With every target ignored the mean is 0 / 0 = NaN and the
// gradients are 0 (as PyTorch's).
// On CUDA the chunk's cross-entropy forward and backward are one kernel that reads the chunk's
// logits once (crossentropy_fwd_bwd_v4, the row held in shared memory between its two passes;
// BT_CUDA_CE_FUSED=0 runs the two kernels instead).
// Higher-order gradients through it are not supported (the saved gradients are constants).
//
// Inputs x (N, K), W (Vp, K), target (N) int64 contiguous.  Outputs: loss () (the summed loss
// over non-ignored rows, or with `mean` their mean; float32 for 16-bit inputs, else x's dtype),
// then dx (N, K) in x's
// dtype if need_dx, then dW (Vp, K) (float32 for 16-bit, else x's dtype) if need_dw.  Only the
// first num_classes columns of the head are classes (a padded vocabulary): the padding columns
// get zero gradient.  chunk_rows: rows per chunk (the front picks it from a byte budget).
class LinearCrossEntropy : public Primitive {
  BT_PRIM_BODY(LinearCrossEntropy, "linear_cross_entropy")
  LinearCrossEntropy(int64_t ii, int64_t nc, int64_t rows, bool ndx, bool ndw, bool m)
      : ignore_index(ii), num_classes(nc), chunk_rows(rows), need_dx(ndx), need_dw(ndw), mean(m) {}
  bool contiguous_input(size_t i) const override { return i == 2; }  // the target
  bool saves_inputs() const override { return false; }
  bool saves_outputs() const override { return true; }
  bool saves_output(size_t i) const override { return i > 0; }        // dx, dW
  bool takes_no_cotangent(size_t i) const override { return i > 0; }  // never returned
  void attrs(Attrs& a) const override {
    a["ignore_index"] = ignore_index;
    a["num_classes"] = num_classes;
    a["chunk_rows"] = chunk_rows;
    a["need_dx"] = need_dx;
    a["need_dw"] = need_dw;
    a["mean"] = mean;
  }
  int64_t ignore_index, num_classes, chunk_rows;
  bool need_dx, need_dw, mean;
};

// How linear_gelu_linear runs its GELU parts on CUDA (BLUTRAIN_LGL_EPILOGUE=kernel|cublaslt, read
// once at first use; tests switch it with set_lgl_impl):
//   Kernel (default): backward dh = dy W2 as a plain GEMM, then our fused du = dh * gelu'(pre)
//     (+ deterministic db1) kernel in place on dh (src/cuda/mlp.cu); float32/64 forward: GEMM then
//     the GeluTanh kernel (cuBLASLt has no fused fp32 GELU epilogue: it runs a slow extra kernel).
//   Cublaslt: cuBLASLt's DGELU(_BGRAD) / GELU_AUX epilogues (the previous behaviour).
//   KernelV1: Kernel with the reference (scalar) dgelu kernel, for tests.
// On the CPU the backward always uses blutrain-linalg's DGELU epilogue (one fused loop there);
// the float32/64 forward follows the setting like CUDA's.
enum class LglImpl : int { Kernel = 0, Cublaslt = 1, KernelV1 = 2 };
LglImpl lgl_impl();
void set_lgl_impl(LglImpl impl);
LglImpl parse_lgl_impl(const std::string& s);  // ValueError on unknown names
const char* lgl_impl_name(LglImpl impl);

namespace cuda {
// d (M, N) contiguous: dh in, du = dh * gelu_tanh'(pre) out (in place); db (N), when defined,
// gets the column sums of du (deterministic; d's dtype, or float32 for 16-bit d: the float32 sums
// unrounded). pre (M, N) contiguous, d's dtype. src/cuda/mlp.cu.
void gelu_tanh_backward_inplace(const Tensor& d, const Tensor& pre, const Tensor& db,
                                const char* op);
// db (N) = column sums of g (M, N) (deterministic: fixed chunks of rows, then the chunks in
// order), db of g's dtype or float32 (src/cuda/mlp.cu).  column_sums_apply: whether it runs g
// (contiguous, 16-byte aligned rows, not float64, M > 0).  LinearWeightGrad uses it for the bias
// gradient unless BLUTRAIN_BGRAD=cublaslt (read once): then cuBLASLt's BGRAD epilogue.
bool column_sums_apply(const Tensor& g);
void column_sums(const Tensor& g, const Tensor& db, const char* op);
// column_sums for any contiguous (M, N) g (the reference kernel where v2 does not apply; zeros
// for M = 0).
void column_sums_any(const Tensor& g, const Tensor& db, const char* op);
bool bias_grad_by_kernel();
// The chunked classifier's cross-entropy on one chunk: logits (N, Cx) contiguous (the first
// num_classes columns are classes), target (N) int64.  Writes lse (N) and row_loss (N) (float32;
// 0 for ignored rows) and, over the logits, the gradient of the summed loss, in one kernel that
// reads the logits once (src/cuda/nn.cu, crossentropy_fwd_bwd_v4).  Returns false, having done
// nothing, where that kernel does not apply (float64, unaligned rows, rows over the shared
// memory of a block, BT_CUDA_CE_FUSED=0); the caller then runs the two cross-entropy kernels.
// scale: () float32, multiplies the gradient (the mean's 1 / count), or undefined for 1.
bool cross_entropy_fwd_bwd_inplace(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                   const Tensor& row_loss, const Tensor& scale, int64_t num_classes,
                                   int64_t ignore_index, const char* op);
// count () and inverse () (one dtype, float32 or float64) = the number of target (N) entries
// != ignore_index and 1 / that number, in one single-block kernel (the chunked classifier's mean).
void count_targets(const Tensor& target, int64_t ignore_index, const Tensor& count,
                   const Tensor& inverse, const char* op);
}  // namespace cuda

// The dtype a weight-gradient GEMM of a vjp writes input i's gradient in: float32 when `dt` is
// 16-bit and that gradient goes unnarrowed to a float32 master (VjpArgs::grad_dtypes, Note
// [cached casts]), else dt.
DType weight_grad_dtype(const VjpArgs& a, size_t i, DType dt);
// A linear layer's weight gradient dW = g^T x (g (M, N), x (M, K) 2-D) in weight_grad_dtype(a,
// iw, ...) and, with want_db, the bias's db = column sums of g in the same dtype (one
// LinearWeightGrad: on CUDA our column-sum kernel, else the GEMM's BGRAD epilogue).  Returns
// {dW, db or undefined}.
std::pair<Tensor, Tensor> linear_weight_grads(const VjpArgs& a, const Tensor& g, const Tensor& x,
                                              const Shape& weight_shape, size_t iw, bool want_db);

// dy * gelu_tanh'(pre), computed in float32 for 16-bit inputs (composed ops: any backend).
Tensor gelu_tanh_backward(const Tensor& dy, const Tensor& pre);

// gelu_tanh(x W^T + b) over x's last dim (x (..., K), W (N, K), b (N) or undefined).
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias);

// linear(linear_gelu(x, w1, b1), w2, b2) fused as above (biases may be undefined); recompute
// saves pre only and recomputes h in backward.
Tensor linear_gelu_linear(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                          const Tensor& b2, bool recompute = false);

// cross_entropy(x W^T, target) over the first num_classes (default: all) columns, reduction
// "mean" or "sum", without keeping the logits (Note [chunked classifier]).  x (..., K), W (V, K),
// target (...) integer; chunk_size: rows per chunk (default: even chunks of at most 512 MiB of
// logits, see autocast.cpp).  The loss is float32 for 16-bit inputs.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& target,
                            int64_t ignore_index, const std::string& reduction,
                            std::optional<int64_t> num_classes, std::optional<int64_t> chunk_size);

}  // namespace bt
